"""The calibration output folder: one safetensors + JSON pair per finished layer, a progress file, and a
manifest written last (its presence means the run is complete).

    OUT/
      manifest.json          recipe, source model + data fingerprints, per-layer summary (written last)
      progress.json          fingerprint and the number of finished layers (drives resume)
      layer_000.safetensors  smoothing scales, quantized codes/scales/zeros, replica banks, loss table, router stats
                             (codes bit-packed exactly as in the artifact: hexq.packed.weight.pack_weight; a bank
                             holds experts.<proj>.b<bits>.codes [E, bytes per expert] and .scale/.zero
                             [E, rows, groups] float16)
      layer_000.json         smoothing exponents and errors, cold-expert fallbacks, damping, token counts
      head.safetensors       the LM head's codes/scale/zero when the recipe quantizes it (hexq.calib.head)
      timings.json           wall time per layer and per stage (the one file that differs between identical
                             runs)

Every file is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import functools
import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from hexq.base.errors import HexqError
from hexq.base.io import SafetensorsWriter, file_record, file_sha256, read_sealed_json, save_tensors, write_json_atomic
from hexq.config.recipe import Recipe, recipe_from_dict
from hexq.model.folder import source_state
from hexq.packed.bitpack import pack_bits, packed_nbytes
from hexq.packed.ggml import BLOCK_TYPES
from hexq.packed.weight import SCALE_DTYPE, PackedWeight, dequantize_packed, pack_weight

FORMAT = "hexq-calibration"
FORMAT_VERSION = 2  # 2: bit-packed codes and float16 scales (1 stored one byte per code)


def layer_paths(out: Path, index: int) -> tuple[Path, Path]:
    return out / f"layer_{index:03d}.safetensors", out / f"layer_{index:03d}.json"


def save_layer(out: Path, index: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tensor_path, meta_path = layer_paths(out, index)
    save_tensors(tensor_path, tensors)
    write_json_atomic(meta_path, meta)


HEAD_FILE = "head.safetensors"


def save_head(out: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """The quantized head's tensors written (atomically); its file record."""
    save_tensors(Path(out) / HEAD_FILE, tensors)
    return {HEAD_FILE: file_record(Path(out) / HEAD_FILE)}


def load_head(out: Path, recipe: Recipe) -> dict[str, torch.Tensor] | None:
    """The quantized head's tensors of a finished calibration made with `recipe` (checked against its record: a
    missing or altered file is named), or None when the recipe keeps the head as stored."""
    if recipe.head is None:
        return None
    path = checked(out, HEAD_FILE)
    try:
        return load_file(path)
    except Exception as exc:  # OSError and safetensors' own error types
        raise HexqError(f"the quantized head in {out} is unreadable ({exc}); rerun hexq calibrate") from None


def layer_meta(out: Path, index: int) -> dict:
    """The JSON summary of one finished layer (without reading its tensors)."""
    _, meta_path = layer_paths(out, index)
    try:
        return json.loads(checked(out, meta_path.name).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HexqError(f"calibration layer {index} in {out} is unreadable ({exc}); rerun hexq calibrate") from None


def load_layer(out: Path, index: int) -> tuple[dict[str, torch.Tensor], dict]:
    tensor_path, meta_path = layer_paths(out, index)
    checked(out, tensor_path.name)
    try:
        return load_file(tensor_path), json.loads(checked(out, meta_path.name).read_text())
    except Exception as exc:  # OSError, JSONDecodeError, and safetensors' own error types
        raise HexqError(f"calibration layer {index} in {out} is unreadable ({exc}); rerun hexq calibrate") from None


@contextmanager
def open_layer(out: Path, index: int):
    """A safe_open handle on one calibration layer's tensors (reads only what is asked, slices included)."""
    from safetensors import SafetensorError, safe_open

    tensor_path, _ = layer_paths(Path(out), index)
    checked(out, tensor_path.name)
    try:
        handle = safe_open(str(tensor_path), framework="pt")
    except (OSError, SafetensorError) as exc:
        raise HexqError(f"calibration layer {index} in {out} is unreadable ({exc}); rerun hexq calibrate") from None
    with handle:
        yield handle


def calibration_source(calib_dir: Path, manifest: CalibrationManifest) -> Path:
    """The model folder a finished calibration was made from, after checking it is still there and unchanged."""
    model_path = manifest.model_path
    state = source_state(model_path, manifest.fingerprint["model"])
    if state == "gone":
        raise HexqError(f"the source model of {calib_dir} is gone: {model_path}")
    if state == "changed":
        raise HexqError(f"the model at {model_path} changed since {calib_dir} was calibrated (weights hash differs)")
    return model_path


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise HexqError(f"{path} is corrupt (not JSON); delete the output folder and rerun") from None


def is_finished(out: Path, fingerprint: dict) -> bool:
    """Does `out` hold a finished calibration of exactly these model, data and recipe (nothing to do)? A folder
    whose manifest fails its seal (edited, or from a hexq before the seal) is not: the output rule decides whether
    it may be replaced."""
    if not (out / "manifest.json").is_file():
        return False
    try:
        manifest = read_sealed_json(out / "manifest.json")
    except HexqError:
        return False
    return isinstance(manifest, dict) and manifest.get("fingerprint") == fingerprint


def layers_done(folder: Path, fingerprint: dict) -> int | None:
    """Layers an unfinished run in `folder` completed for this fingerprint (0 when it holds nothing yet), or None
    when its work belongs to another model, data or recipe."""
    progress = read_json(folder / "progress.json")
    if progress is None:
        return 0
    if progress.get("fingerprint") != fingerprint:
        return None
    return int(progress.get("layers_done", 0))


def differing_inputs(folder: Path, fingerprint: dict) -> str:
    """Which of model, data and recipe an unfinished run in `folder` was made from differently."""
    recorded = (read_json(folder / "progress.json") or {}).get("fingerprint") or {}
    names = {"data": "calibration text"}
    return ", ".join(names.get(key, key) for key in fingerprint if recorded.get(key) != fingerprint[key]) or "input"


def write_progress(out: Path, fingerprint: dict, layers_done: int, files: dict | None = None) -> None:
    """The resume point: layers done for this fingerprint and the size and SHA-256 of every file they wrote."""
    write_json_atomic(out / "progress.json", {"format": FORMAT, "fingerprint": fingerprint, "layers_done": layers_done,
                                              "files": files or {}})


def progress_files(out: Path) -> dict:
    """The file records of an unfinished run (progress.json), for resuming."""
    progress = read_json(Path(out) / "progress.json") or {}
    files = progress.get("files", {})
    return files if isinstance(files, dict) else {}


def layer_file_records(out: Path, index: int) -> dict[str, dict]:
    """{file name: {sha256, bytes}} of one finished layer's files."""
    names = [path.name for path in layer_paths(out, index)] + [bank_path(out, index).name]
    return {name: file_record(Path(out) / name) for name in names if (Path(out) / name).is_file()}


_checked: set[tuple[str, int, int]] = set()  # (path, size, mtime) of calibration files verified by this process


def checked(out: Path, name: str) -> Path:
    """The path of calibration file `name`, after checking its size and SHA-256 against the record the calibration
    made when it wrote it (the sealed manifest of a finished calibration, progress.json of an unfinished one), once
    per process. A file written by the run in progress before its layer is recorded is not checked."""
    out = Path(out)
    path = out / name
    manifest_path = out / "manifest.json"
    records = read_sealed_json(manifest_path).get("files", {}) if manifest_path.is_file() else progress_files(out)
    expected = records.get(name)
    if expected is None:
        if manifest_path.is_file():
            raise HexqError(f"calibration file {path} is not listed in {manifest_path}; calibrate again")
        return path
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise HexqError(f"calibration file {path} is missing; calibrate again") from None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _checked:
        return path
    if stat.st_size != expected.get("bytes"):
        raise HexqError(f"calibration file {path} is truncated or altered: {stat.st_size} bytes, the record says "
                        f"{expected.get('bytes')}")
    actual = file_sha256(path)
    if actual != expected.get("sha256"):
        raise HexqError(f"calibration file {path} is corrupt: sha256 {actual[:16]}..., the record says "
                        f"{str(expected.get('sha256'))[:16]}...")
    _checked.add(key)
    return path


@dataclass(frozen=True)
class CalibrationManifest:
    """What a finished calibration's manifest.json says (written by hexq.calib.pipeline, read only through
    read_manifest): the source model and its shape, the fingerprints of model, data and recipe, the recipe, and the
    widths of the replica banks."""

    model_path: Path
    model_type: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int
    fingerprint: dict[str, str]  # sha256 of "model", "data", "recipe"
    data: dict  # source, num_samples, seqlen, seed, tokens_available
    recipe: Recipe
    expert_bits: list[int]  # the replica banks' widths (and the loss table's columns)
    hexq_version: str


def _field(where: Path, manifest: dict, kind: type, *keys: str):
    value = manifest
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise HexqError(f"{where}: manifest.json has no {'.'.join(keys)} of type {kind.__name__}; calibrate again")
    return value


def read_manifest(out: Path) -> CalibrationManifest:
    """The manifest of a finished calibration, its seal checked (an edit is named), format and version too, and
    every field it is read for present (a missing one is named)."""
    path = Path(out) / "manifest.json"
    if not path.is_file():
        raise HexqError(f"{out} is not a finished hexq calibration folder (no manifest.json)")
    manifest = read_sealed_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise HexqError(f"{out} is not a finished hexq calibration folder (no manifest.json)")
    version = manifest.get("format_version", 0)
    if version > FORMAT_VERSION:
        raise HexqError(f"{out} was written by a newer hexq (format {version}); upgrade hexq")
    if version < FORMAT_VERSION:
        raise HexqError(f"{out} was written by an older hexq (calibration format {version}, this hexq reads "
                        f"{FORMAT_VERSION}); calibrate again")
    field = functools.partial(_field, path, manifest)
    return CalibrationManifest(
        model_path=Path(field(str, "model", "path")), model_type=field(str, "model", "model_type"),
        num_layers=field(int, "model", "layers"), moe_layers=field(list, "model", "moe_layers"),
        num_experts=field(int, "model", "num_experts"), top_k=field(int, "model", "top_k"),
        fingerprint=field(dict, "fingerprint"), data=field(dict, "data"),
        recipe=recipe_from_dict(field(dict, "recipe")), expert_bits=field(list, "expert_bits"),
        hexq_version=field(str, "hexq_version"))


# ------------------------------------------------------------------------------------------ packed weights


def put_packed(tensors: dict, prefix: str, codes: torch.Tensor, meta) -> None:
    """One quantized matrix [out, in] under `prefix`: bit-packed codes and float16 scale/zero."""
    tensors.update(pack_weight(codes, meta).tensors(prefix))


def packed_matrix(tensors: dict, prefix: str, shape: tuple[int, int], bits: int):
    """The PackedWeight stored under `prefix` by put_packed."""
    return PackedWeight(tensors[f"{prefix}.codes"], tensors[f"{prefix}.scale"], tensors[f"{prefix}.zero"], bits,
                        tuple(shape))


class ExpertBank:
    """One layer's replica bank, written to its own file chunk by chunk as GPTQ produces it, so a layer's bank (1.4x
    its bf16 experts for widths 1-8) is never held in memory: per (projection, bits), packed codes [E, bytes] and
    float16 scale/zero [E, rows, groups], each chunk's rows written in place
    (hexq.base.io.SafetensorsWriter.write_rows); the file appears, complete, when `close` is called."""

    def __init__(self, path: Path, num_experts: int, shapes: dict[str, tuple[int, int]], bits_list: tuple[int, ...],
                 group_sizes: dict[str, int], export: tuple[int, int] | None = None,
                 kquants: dict[str, tuple[str, ...]] | None = None, attach: str | None = None) -> None:
        """export: (bits, group size) of the export-target replica (hexq.calib.quantize.export_spec) stored beside
        the bank under export.<proj>.b<bits>, if the recipe asks for one; kquants: {projection: K-quant names} of
        the GGUF replicas (hexq.calib.quantize.kquant_kinds), stored as GGML blocks under gguf.<proj>.<kind>
        [E, bytes]. attach: the temporary file of the bank another process (rank 0) is writing, whose rows of other
        experts this one writes (hexq.base.io.SafetensorsWriter's attach)."""
        entries = [(bank_prefix(p, bits), p, bits, group_sizes[p]) for p in shapes for bits in bits_list]
        if export is not None:
            entries += [(bank_prefix(p, export[0], export=True), p, export[0], export[1]) for p in shapes]
        specs = {}
        for prefix, projection, bits, group in entries:
            rows, cols = shapes[projection]
            specs[f"{prefix}.codes"] = (torch.uint8, (num_experts, packed_nbytes(rows * cols, bits)))
            specs[f"{prefix}.scale"] = (SCALE_DTYPE, (num_experts, rows, cols // group))
            specs[f"{prefix}.zero"] = (SCALE_DTYPE, (num_experts, rows, cols // group))
        for projection, kinds in (kquants or {}).items():
            rows, cols = shapes[projection]
            for kind in kinds:
                specs[kquant_bank_key(projection, kind)] = (torch.uint8, (num_experts,
                                                                          rows * BLOCK_TYPES[kind].row_bytes(cols)))
        self.writer = SafetensorsWriter(path, dict(sorted(specs.items())), attach=attach)

    def accept_rows_of(self, experts: range) -> None:
        """Count every tensor's rows of `experts` as written (by the rank that owns them)."""
        for name in self.writer.names:
            self.writer.accept_rows(name, experts.start, len(experts))

    def put_blocks(self, projection: str, kind: str, experts: list[int], blocks: torch.Tensor) -> None:
        """GGUF blocks [n, bytes] of the consecutive experts `experts` (kquants in __init__)."""
        self.writer.write_rows(kquant_bank_key(projection, kind), experts[0], blocks)

    def put(self, projection: str, bits: int, experts: list[int], codes: torch.Tensor, scale: torch.Tensor,
            zero: torch.Tensor, export: bool = False) -> None:
        """codes [n, rows, cols] (uint8 on the grid), scale/zero [n, rows, groups] of the consecutive experts
        `experts` (export: the export-target replica)."""
        prefix, first = bank_prefix(projection, bits, export), experts[0]
        if experts != list(range(first, first + len(experts))):
            raise ValueError(f"a bank chunk must hold consecutive experts, got {experts}")
        # packed where GPTQ made them: on a GPU the host then receives bits / 8 of the bytes and does no packing
        if one_stream(codes[0].numel(), bits):
            packed = pack_bits(codes, bits).reshape(len(experts), -1)
        else:
            packed = torch.stack([pack_bits(matrix, bits) for matrix in codes])
        self.writer.write_rows(f"{prefix}.codes", first, packed.cpu())
        self.writer.write_rows(f"{prefix}.scale", first, scale.to(SCALE_DTYPE).cpu())
        self.writer.write_rows(f"{prefix}.zero", first, zero.to(SCALE_DTYPE).cpu())

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


def kquant_bank_key(projection: str, kind: str) -> str:
    return f"gguf.{projection}.{kind}"


def bank_path(out: Path, index: int) -> Path:
    return Path(out) / f"layer_{index:03d}.bank.safetensors"


@contextmanager
def open_bank(out: Path, index: int):
    """A safe_open handle on one layer's replica bank (rows are read on demand; closed at the end of the block, so
    the pages read stop counting in the process's memory)."""
    from safetensors import SafetensorError, safe_open

    path = checked(out, bank_path(out, index).name)
    try:
        handle = safe_open(str(path), framework="pt")
    except (OSError, SafetensorError) as exc:
        raise HexqError(f"calibration bank of layer {index} in {out} is unreadable ({exc}); rerun hexq calibrate") \
            from None
    with handle:
        yield handle


def bank_prefix(projection: str, bits: int, export: bool = False) -> str:
    """Keys of one replica in a bank file: experts.<proj>.b<bits>, or export.<proj>.b<bits> for the export-target
    replica."""
    return f"{'export' if export else 'experts'}.{projection}.b{bits}"


def bank_rows(bank, key: str, experts: list[int]) -> torch.Tensor:
    """Rows `experts` of a bank tensor, from a dict of tensors or a safe_open handle (consecutive rows are one read)."""
    if isinstance(bank, dict):
        return bank[key][experts]
    if experts == list(range(experts[0], experts[0] + len(experts))):
        return bank.get_slice(key)[experts[0]:experts[-1] + 1]
    return torch.stack([bank.get_slice(key)[e] for e in experts])


def one_stream(numel: int, bits: int) -> bool:
    """Whether consecutive experts' codes of `numel` each packed as one stream are their own streams end to end: when
    each takes whole bytes (ExpertBank.put writes a chunk so, bank_weights reads it so)."""
    return numel * bits % 8 == 0


def bank_weights(bank, projection: str, bits: int, experts: list[int], shape: tuple[int, int],
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The experts' replica at `bits`, dequantized [n, rows, cols] in `dtype` on `device`; `bank` is an open bank
    (open_bank) or a dict of its tensors."""
    prefix = bank_prefix(projection, bits)
    # the packed bytes go to the device and are dequantized there (a GPU calibration dequantized five widths of
    # every expert on the CPU before)
    codes, scale, zero = (bank_rows(bank, f"{prefix}.{part}", experts).to(device)
                          for part in ("codes", "scale", "zero"))
    rows, cols = shape
    if one_stream(rows * cols, bits):
        stacked = PackedWeight(codes.reshape(-1), scale.flatten(0, 1), zero.flatten(0, 1), bits, (len(experts) * rows,
                                                                                                  cols))
        return dequantize_packed(stacked, dtype).view(len(experts), rows, cols)
    return torch.stack([dequantize_packed(PackedWeight(codes[j], scale[j], zero[j], bits, tuple(shape)), dtype)
                        for j in range(len(experts))])
