"""The calibration output folder: one safetensors + JSON pair per finished layer, a progress file, and a
manifest written last (its presence means the run is complete).

    OUT/
      manifest.json          recipe, source model + data fingerprints, per-layer summary (written last)
      progress.json          fingerprint and the number of finished layers (drives resume)
      layer_000.safetensors  smoothing scales, quantized codes/scales/zeros, replica banks, loss table, router stats
      layer_000.json         smoothing exponents and errors, cold-expert fallbacks, damping, token counts
      timings.json           wall time per layer (the one file that differs between identical runs)

Every file is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from hexq.errors import HexqError
from hexq.io import write_bytes_atomic, write_json_atomic

FORMAT = "hexq-calibration"
FORMAT_VERSION = 1


def layer_paths(out: Path, index: int) -> tuple[Path, Path]:
    return out / f"layer_{index:03d}.safetensors", out / f"layer_{index:03d}.json"


def save_layer(out: Path, index: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tensor_path, meta_path = layer_paths(out, index)
    contiguous = {name: t.detach().cpu().contiguous() for name, t in sorted(tensors.items())}
    write_bytes_atomic(tensor_path, save(contiguous))
    write_json_atomic(meta_path, meta)


def load_layer(out: Path, index: int) -> tuple[dict[str, torch.Tensor], dict]:
    tensor_path, meta_path = layer_paths(out, index)
    try:
        return load_file(tensor_path), json.loads(meta_path.read_text())
    except Exception as exc:  # OSError, JSONDecodeError, and safetensors' own error types
        raise HexqError(f"calibration layer {index} in {out} is unreadable ({exc}); rerun hexq calibrate") from None


def sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(folder: Path) -> str:
    """SHA-256 over the model's weights and config (not its tokenizer or card)."""
    return sha256_files([*folder.glob("*.safetensors"), folder / "config.json"])


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise HexqError(f"{path} is corrupt (not JSON); delete the output folder and rerun") from None


def check_output_folder(out: Path, fingerprint: dict) -> int:
    """How many layers are already done for this fingerprint (0 for a new run); fails on a folder that holds
    another calibration or unrelated files."""
    if not out.exists():
        return 0
    if not out.is_dir():
        raise HexqError(f"output {out} exists and is not a folder")
    manifest = read_json(out / "manifest.json")
    progress = read_json(out / "progress.json")
    recorded = (manifest or progress or {}).get("fingerprint")
    if recorded is None:
        if any(out.iterdir()):
            raise HexqError(f"output folder {out} is not empty and holds no hexq calibration; choose another -o")
        return 0
    if recorded != fingerprint:
        differs = ", ".join(k for k in fingerprint if recorded.get(k) != fingerprint[k])
        raise HexqError(f"output folder {out} holds a calibration of a different {differs}; "
                        "choose another -o or delete it")
    if manifest is not None:
        return -1  # complete
    return int(progress.get("layers_done", 0))


def write_progress(out: Path, fingerprint: dict, layers_done: int) -> None:
    write_json_atomic(out / "progress.json", {"format": FORMAT, "fingerprint": fingerprint, "layers_done": layers_done})


def read_manifest(out: Path) -> dict:
    manifest = read_json(Path(out) / "manifest.json")
    if manifest is None or manifest.get("format") != FORMAT:
        raise HexqError(f"{out} is not a finished hexq calibration folder (no manifest.json)")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise HexqError(f"{out} was written by a newer hexq (format {manifest['format_version']}); upgrade hexq")
    return manifest
