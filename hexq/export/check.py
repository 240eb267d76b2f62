"""The export check: the written folder reloaded through compressed-tensors' own decompressors (ExportReader) and
run streamed beside the served model and the source checkpoint (hexq.export, "The check")."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hexq.artifact.format import HEAD_WEIGHT
from hexq.artifact.reader import Artifact
from hexq.base.data import eval_text, tokenize
from hexq.base.errors import HexqError
from hexq.eval.perplexity import make_windows
from hexq.export.codec import (
    INDEX,
    SINGLE,
    expert_modules,
    hub_name,
)
from hexq.model.adapters import MoEAdapter, adapter_for
from hexq.model.checkpoint import safetensors_dtype
from hexq.model.layer_pass import ExpertCompute, expert_chunk, full_precision_plan, stream_layers
from hexq.model.streaming import LoadedLayer, StreamedModel, open_model
from hexq.packed.weight import PackedWeight, dequantize_packed
from hexq.runtime.model import artifact_model

Progress = Callable[[str, int, int], None]
@dataclass(frozen=True)
class Thresholds:
    """The check's limits against the served model (see the module docstring for where they come from)."""

    exact_rel_l2: float = 1e-2
    projected_rel_l2: float = 0.05
    projected_argmax: float = 0.90


THRESHOLDS = Thresholds()
# Logits computed at once per compared model ([positions, vocabulary] float32, 64 MiB; three models and the
# comparison's temporaries take ~10 such blocks): the positions per step shrink with the vocabulary, so the check's
# memory does not grow with it (110 positions per step at 151,936 tokens).
LOGIT_ELEMENTS = 1 << 24
HEAD_ROWS = 4096  # rows of the head dequantized (to compare it with the export's) or upcast (for logits) at a time




# ------------------------------------------------------------------------------------------ reading back


class ExportReader:
    """A written export read back one tensor at a time, as a streamed model's LayerSource: quantized modules
    dequantized by compressed-tensors' own registered decompressor for the config group that targets them (matched
    by compressed-tensors' `match_name`), everything else as stored. Every key read is recorded, so that `unread`
    names what a loader would have ignored."""

    def __init__(self, folder: str | Path, adapter: MoEAdapter) -> None:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        self.folder = Path(folder)
        self.adapter = adapter
        config = json.loads((self.folder / "config.json").read_text())
        try:
            self.qconfig = QuantizationConfig.model_validate(config["quantization_config"])
        except Exception as exc:  # pydantic's ValidationError, KeyError
            raise HexqError(f"{self.folder}/config.json has no valid compressed-tensors quantization_config: "
                            f"{str(exc).splitlines()[0]}") from None
        self.schemes = list(self.qconfig.config_groups.values())
        self.compressors = [BaseCompressor.get_value_from_registry(scheme.format) for scheme in self.schemes]
        index = self.folder / INDEX
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            with safe_open(str(self.folder / SINGLE), framework="pt") as handle:
                self.weight_map = dict.fromkeys(handle.keys(), SINGLE)
        self.read_keys: set[str] = set()
        self._handles: dict[str, object] = {}

    def _tensor(self, key: str) -> torch.Tensor:
        shard = self.weight_map.get(key)
        if shard is None:
            raise HexqError(f"{self.folder}: tensor {key} is missing from the export")
        self.read_keys.add(key)
        return self._tensor_handle(shard).get_tensor(key)

    def scheme_of(self, module: str):
        """(index, QuantizationScheme) of the config group targeting `module`, or None."""
        from compressed_tensors.utils.match import match_name

        if any(match_name(module, ignore) for ignore in self.qconfig.ignore or []):
            return None
        for index, scheme in enumerate(self.schemes):
            if any(match_name(module, target) for target in scheme.targets):
                return index, scheme
        return None

    def module_weight(self, module: str) -> torch.Tensor:
        """The dequantized weight of a quantized module, through compressed-tensors' decompressor."""
        index, scheme = self.scheme_of(module)
        compressor = self.compressors[index]
        state = {name: self._tensor(f"{module}.{name}") for name in compressor.compression_param_names(scheme)}
        return compressor.decompress(state, scheme)["weight"]

    def activation_args(self, module: str):
        """The input-activation QuantizationArgs of a module, or None."""
        found = self.scheme_of(module)
        return None if found is None else found[1].input_activations

    def has_param(self, name: str) -> bool:
        key = hub_name(name, self.adapter)
        if key.endswith(".weight") and self.scheme_of(key.removesuffix(".weight")) is not None:
            return True
        return key in self.weight_map

    def read_param(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        key = hub_name(name, self.adapter)
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and self.scheme_of(module) is not None:
            tensor = self.module_weight(module)
        else:
            tensor = self._tensor(key)
        if tuple(tensor.shape) != tuple(shape):
            raise HexqError(f"{self.folder}: {key} has shape {list(tensor.shape)}, the model needs {list(shape)}")
        return tensor

    def param_dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype of a parameter (a quantized module dequantizes to float32), without reading it."""
        key = hub_name(name, self.adapter)
        if key.endswith(".weight") and self.scheme_of(key.removesuffix(".weight")) is not None:
            return torch.float32
        shard = self.weight_map.get(key)
        if shard is None:
            return None
        self._tensor_handle(shard)
        return safetensors_dtype(self._handles[shard].get_slice(key).get_dtype())

    def release(self) -> None:
        """Close the shards' memory maps after a layer (their pages stop counting in the process's memory)."""
        self._handles.clear()

    def _tensor_handle(self, shard: str):
        from safetensors import safe_open

        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(str(self.folder / shard), framework="pt")
        return handle

    def expert_weights(self, layer: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [n, 2I, H], down [n, H, I]) of routed experts of a layer, dequantized (float32)."""
        gate_up, down = [], []
        for expert in experts:
            gate, up, down_name = expert_modules(layer, expert, self.adapter)
            gate_up.append(torch.cat([self.module_weight(gate), self.module_weight(up)]).float())
            down.append(self.module_weight(down_name).float())
        return torch.stack(gate_up), torch.stack(down)

    def unread(self) -> list[str]:
        return sorted(set(self.weight_map) - self.read_keys)



# ------------------------------------------------------------------------------------------ the check


@dataclass(frozen=True)
class Comparison:
    """Logits of `model` against `reference` on the same windows."""

    model: str
    reference: str
    rel_l2: float  # ||l_model - l_ref|| / ||l_ref|| over every position
    max_abs: float  # max |delta logit|
    argmax_agreement: float  # share of positions with the same top token
    ppl_model: float
    ppl_reference: float

    @property
    def ppl_change(self) -> float:
        return self.ppl_model / self.ppl_reference - 1


@dataclass(frozen=True)
class CheckResult:
    windows: int
    seqlen: int
    tokens_scored: int
    vs_served: Comparison
    vs_full_precision: Comparison | None
    full_precision_note: str
    limit: dict
    passed: bool


class LogitAccumulator:
    """Two models' logits compared position by position (the sums a Comparison is computed from)."""

    def __init__(self) -> None:
        self.diff2 = self.ref2 = 0.0
        self.max_abs = 0.0
        self.agree = self.positions = 0
        self.nll_model = self.nll_ref = 0.0
        self.scored = 0

    def add(self, model: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor | None) -> None:
        """Logits [n, V] of both at the same positions; targets [n] (the next token) for the positions scored."""
        delta = model - ref  # float32, summed in float64: no float64 copy of [n, V] logits (1.2 GB at 150k tokens)
        self.diff2 += float(delta.square().sum(dtype=torch.float64))
        self.ref2 += float(ref.square().sum(dtype=torch.float64))
        self.max_abs = max(self.max_abs, float(delta.abs().max()))
        self.agree += int((model.argmax(-1) == ref.argmax(-1)).sum())
        self.positions += model.shape[0]
        if targets is not None:
            keep = targets >= 0
            self.nll_model += float(F.cross_entropy(model[keep], targets[keep], reduction="sum"))
            self.nll_ref += float(F.cross_entropy(ref[keep], targets[keep], reduction="sum"))
            self.scored += int(keep.sum())

    def result(self, model: str, reference: str) -> Comparison:
        return Comparison(model, reference, math.sqrt(self.diff2 / max(self.ref2, 1e-30)), self.max_abs,
                          self.agree / max(self.positions, 1), math.exp(self.nll_model / max(self.scored, 1)),
                          math.exp(self.nll_ref / max(self.scored, 1)))


def _ct_activation(args) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dynamic per-token activation fake quantization exactly as compressed-tensors computes it (its own qparams and
    fake_quantize), for the reloaded model."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    def quantize(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 1, x.shape[-1])  # token strategy reduces every dim but the first two
        scale, zero = compute_dynamic_scales_and_zp(flat, args, module=None)
        return fake_quantize(flat, scale, zero, args).reshape(x.shape)

    return quantize


def export_model(folder: Path, adapter: MoEAdapter):
    """(streamed model, prepare, reader) of a written export: weights through ExportReader, activation quantization
    from its config groups."""
    from transformers import AutoConfig


    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the skeleton is a plain model; the reader dequantizes
    reader = ExportReader(folder, adapter)
    streamed = StreamedModel(config, reader, torch.device("cpu"))

    def prepare(loaded: LoadedLayer) -> ExpertCompute | None:
        for name, module in loaded.module.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            args = reader.activation_args(hub_name(f"model.layers.{loaded.index}.{name}", adapter))
            if args is not None:
                quantize = _ct_activation(args)
                loaded.hooks.append(module.register_forward_pre_hook(
                    lambda _m, inputs, q=quantize: (q(inputs[0]), *inputs[1:])))
        if not loaded.is_moe:
            return None
        gate, _up, down = expert_modules(loaded.index, 0, adapter)
        acts = [reader.activation_args(gate), reader.activation_args(down)]
        _num, gate_up_shape, down_shape = loaded.shapes
        return ExpertCompute(lambda experts: reader.expert_weights(loaded.index, experts),
                             *[None if a is None else _ct_activation(a) for a in acts],
                             chunk=expert_chunk(gate_up_shape, down_shape, torch.float32))

    return streamed, prepare, reader


def _read_top(source, name: str, shape: tuple) -> torch.Tensor:
    """A top-level tensor as stored (not upcast: a float32 copy of a 150k-token head is 1.2 GB)."""
    if name == "lm_head.weight" and not source.has_param(name):  # tied to the embeddings
        name = "model.embed_tokens.weight"
    return source.read_param(name, shape)


def _same_tensor(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> bool:
    """Equal values, compared a block of rows at a time in float32 (the sources may store different dtypes)."""
    return a.shape == b.shape and all(torch.equal(a[i:i + rows].float(), b[i:i + rows].float())
                                      for i in range(0, max(a.shape[0], 1), rows))


def _same_dequantized(written: torch.Tensor, packed: PackedWeight) -> bool:
    """Whether `written` holds the packed matrix dequantized into its dtype, HEAD_ROWS rows at a time (whole, a
    float32 copy of a 151,936-token head would be 1.2 GB)."""
    # rows that do not end on a byte cannot be cut out: then one block
    rows = packed.shape[0] if packed.shape[1] * packed.bits % 8 else HEAD_ROWS
    return tuple(written.shape) == tuple(packed.shape) and all(
        torch.equal(written[i:i + rows], dequantize_packed(packed.rows(i, i + rows), written.dtype))
        for i in range(0, packed.shape[0], rows))


def _logits(states: dict[str, torch.Tensor], head: torch.Tensor,
            bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each model's states [n, hidden] times the head [vocab, hidden] as stored (plus its bias), in float32: HEAD_ROWS
    rows of the head upcast at a time and used for every model (whole, a float32 copy of a 151,936-token head is
    1.2 GB)."""
    states = {name: s.float() for name, s in states.items()}
    out = {name: torch.empty(s.shape[0], head.shape[0]) for name, s in states.items()}
    for start in range(0, head.shape[0], HEAD_ROWS):
        rows = slice(start, start + HEAD_ROWS)
        block = head[rows].float().T
        for name, s in states.items():
            out[name][:, rows] = s @ block
    if bias is not None:
        for logits in out.values():
            logits += bias.float()
    return out


def _same_head(sources: dict[str, object], shapes: dict[str, tuple]) -> None:
    """The final norm and head read from every model's own source must be the same tensors (the comparison then
    computes every model's logits with one materialized head)."""
    (reference_name, reference), *others = sources.items()
    for name, shape in shapes.items():
        want = _read_top(reference, name, shape)
        for other_name, source in others:
            if not _same_tensor(_read_top(source, name, shape), want):
                raise HexqError(f"{name} differs between the {reference_name} and the {other_name} model: the "
                                "logits cannot be compared with one head")


def check_export(artifact: Artifact, folder: Path, windows: int = 8, seqlen: int = 256, data: str = "austen",
                 source: Path | None = None, batch_size: int = 4, projected: bool = False,
                 thresholds: Thresholds = THRESHOLDS, progress: Progress | None = None) -> CheckResult:
    """Reload `folder` and compare its logits with the served model and full precision (module docstring)."""
    device = torch.device("cpu")
    adapter = adapter_for(artifact.model_type)
    served, tokenizer, served_prepare = artifact_model(artifact, device)
    exported, export_prepare, reader = export_model(folder, adapter)
    ids = make_windows(tokenize(tokenizer, eval_text(data)), seqlen, windows)
    models = {"export": (exported, export_prepare), "served": (served, served_prepare)}
    note = "compared"
    if source is not None:
        fp, _tok = open_model(source, device)
        models["full precision"] = (fp, full_precision_plan(fp))
    hidden = {}
    try:
        for position, (name, (streamed, prepare)) in enumerate(models.items()):
            def report(what, done, total, step=position):
                if progress:
                    progress(f"check: {list(models)[step]}", done, total)

            hidden[name] = stream_layers(streamed, ids, batch_size, prepare, progress=report)
        head_shape = tuple(exported.model.lm_head.weight.shape)
        shapes = {"model.norm.weight": tuple(exported.model.model.norm.weight.shape)}
        head = _read_top(exported.source, HEAD_WEIGHT, head_shape)  # as stored: never a float32 copy of it
        bias = (None if exported.model.lm_head.bias is None  # PhiMoE's head has one
                else exported.source.read_param("lm_head.bias", (head_shape[0],)))
        if HEAD_WEIGHT in artifact.quantized_linears:
            # the export's head must be the served one's codes dequantized (hexq.export.write.top_specs); every model's
            # logits below are computed with it, so the comparisons measure the decoder layers, not the head
            if not _same_dequantized(head, artifact.packed_param(HEAD_WEIGHT, head_shape)):
                raise HexqError(f"{HEAD_WEIGHT} of the export is not the served head's codes dequantized")
        else:
            shapes[HEAD_WEIGHT] = head_shape
        _same_head({name: streamed.source for name, (streamed, _p) in models.items()}, shapes)
        artifact.release()
        served_acc, fp_acc = LogitAccumulator(), LogitAccumulator()
        with exported.parts("model.norm"):
            norm = exported.model.model.norm
            for index, batch in enumerate(ids.split(batch_size)):
                targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -1)], dim=1).reshape(-1)
                states = {name: norm(store[index]).reshape(-1, store[index].shape[-1])
                          for name, store in hidden.items()}
                step = max(1, LOGIT_ELEMENTS // head_shape[0])  # positions whose logits fit the bound
                for start in range(0, targets.shape[0], step):
                    chunk = slice(start, start + step)
                    logits = _logits({name: s[chunk] for name, s in states.items()}, head, bias)
                    served_acc.add(logits["export"], logits["served"], targets[chunk])
                    if "full precision" in logits:
                        fp_acc.add(logits["export"], logits["full precision"], targets[chunk])
    finally:
        for store in hidden.values():
            store.close()
    unread = reader.unread()
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise HexqError(f"{folder}: tensor {unread[0]}{more} is in the export but no part of the model reads it (a "
                        "loader would ignore it)")
    vs_served = served_acc.result("export", "served")
    vs_fp = fp_acc.result("export", "full precision") if source is not None else None
    if source is None:
        note = "source checkpoint not available"
    if projected:
        limit = {"rel_l2": thresholds.projected_rel_l2, "argmax_agreement": thresholds.projected_argmax}
        passed = vs_served.rel_l2 <= limit["rel_l2"] and vs_served.argmax_agreement >= limit["argmax_agreement"]
    else:
        limit = {"rel_l2": thresholds.exact_rel_l2}
        passed = vs_served.rel_l2 <= limit["rel_l2"]
    return CheckResult(int(ids.shape[0]), seqlen, served_acc.scored, vs_served, vs_fp, note, limit, passed)
