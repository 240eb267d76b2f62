"""`hexq export`: an artifact written as a compressed-tensors checkpoint, one decoder layer at a time, with every
part in the scheme calibration gave it wherever compressed-tensors can express it, then checked against the model
`hexq run` serves.

What each part becomes (hexq.artifact.export explains the exact code mapping):
- attention, shared experts and dense layers' MLPs: the artifact's own grid (bits, groups or channels, symmetric or
  asymmetric with integer zero points) and activation setting (dynamic per-token, or none): bit-identical
  dequantized weights. Static activation ranges are refused (compressed-tensors would need per-tensor input scales
  that hexq does not write).
- routed experts: one scheme per layer (vLLM's fused MoE needs one), the artifact's expert grid at T = 4 or 8 bits.
  Every expert whose allocated b-bit code fits the T-bit scheme is written unchanged (b <= T; 1-bit symmetric as
  +-1 codes at half the scale); a skipped expert is exact zeros. An expert that does not fit (an 8-bit expert in a
  4-bit layer, 1-bit asymmetric) is projected onto the layer's scheme with a GPTQ replica in that scheme: the
  artifact's export replicas (`hexq pack` keeps them for such experts, see hexq.artifact.pack), else the widest
  stored bank replica that fits; round-to-nearest from the allocated weights only when no replica exists.
  `experts="auto"` gives a layer T = 4 unless that would need round-to-nearest, and T = 8 (every width exact) then.
- embeddings, norms, routers, biases: as stored in the artifact.

Peak memory: one expert's codes being re-packed, plus the open shards' headers; the check below streams three models
one layer at a time.

The check (`check_export`) reloads the written folder through `ExportReader` (compressed-tensors' own
decompressors, per module; every file key must be read, none missing) and runs it streamed on held-out windows
beside (a) the artifact's model as `hexq run --policy static` serves it (hexq.runtime.model.artifact_model) and
(b) the source checkpoint in full precision when it is still there. It reports relative L2 of the logits, max
|delta logit|, argmax agreement and perplexity for each pair, and fails above `THRESHOLDS`:

- No projected expert: the export's weights are the served model's bit for bit, so what is left is activation
  quantization computed by compressed-tensors' code instead of hexq's: the same grid, but hexq rounds x/s + 128 (its
  codes are unsigned) where compressed-tensors rounds x/s, and about 7e-5 of the activations fall on the other side
  of a tie. Measured on 8 windows x 256 of held-out austen: relative L2 0 to 1e-4 (asymmetric activations, tiny
  models), 7.9e-4 (random Qwen2-MoE), 1.4e-3 and 3.4e-3 (symmetric activations, Qwen3-MoE and Mixtral reference
  models). Limit: relative L2 1e-2; a wrong scale on one layer's experts fails it (tests/test_export.py).
- Projected experts: the difference also holds what each replica used costs against the allocated one (an 8-bit
  expert at its 4-bit GPTQ replica). Limit: relative L2 0.05 and argmax agreement at least 90% (README gives the
  measured values).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hexq.adapters import MoEAdapter, adapter_for
from hexq.artifact.export import (
    ActSpec,
    CtScheme,
    CtWeight,
    ExportReader,
    ShardedWriter,
    expert_modules,
    experts_target,
    export_shard,
    hub_name,
    module_specs,
    module_tensors,
    quantization_config,
    retarget,
    rtn_weight,
    scheme_fits,
    vllm_support,
    zero_weight,
)
from hexq.artifact.format import (
    PROJECTIONS,
    STATS_SHARD,
    TOP_SHARD,
    Artifact,
    PackedWeight,
    dense_shard,
    dequantize_packed,
    replica_key,
)
from hexq.errors import HexqError
from hexq.recipe import recipe_from_dict

Progress = Callable[[str, int, int], None]
EXPERT_MODES = ("auto", "w4", "w8", "vllm")
DEFAULT_SHARD_BYTES = 5 * 10**9  # as save_pretrained's default max_shard_size "5GB"
EXPORT_REPORT = "hexq_export.json"


@dataclass(frozen=True)
class Thresholds:
    """The check's limits against the served model (see the module docstring for where they come from)."""

    exact_rel_l2: float = 1e-2
    projected_rel_l2: float = 0.05
    projected_argmax: float = 0.90


THRESHOLDS = Thresholds()
# Logits computed at once per compared model ([positions, vocabulary] float32, 256 MiB): the positions per step shrink
# with the vocabulary, so the check's memory does not grow with it.
LOGIT_ELEMENTS = 1 << 26


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class ExpertChoice:
    """How one routed expert is written: `source` exact | zero | replica | export-replica | rtn, at `bits`."""

    expert: int
    allocated: int
    source: str
    bits: int
    mse_allocated: float | None = None  # loss-table MSE of the allocated replica
    mse_used: float | None = None  # loss-table MSE of the replica written (None: not in the table)


@dataclass(frozen=True)
class LayerExport:
    layer: int
    scheme: CtScheme
    choices: tuple[ExpertChoice, ...]

    @property
    def projected(self) -> list[ExpertChoice]:
        return [c for c in self.choices if c.source not in ("exact", "zero")]


def activation_spec(setting, what: str) -> ActSpec | None:
    if setting.bits is None:
        return None
    if not setting.dynamic:
        raise HexqError(f"the artifact's {what} use static activation ranges, which hexq does not export; "
                        "calibrate with dynamic activations (activations.dynamic: true)")
    return ActSpec(setting.bits, setting.symmetric)


def dense_scheme(artifact: Artifact) -> CtScheme:
    recipe = recipe_from_dict(artifact.manifest["recipe"])
    w = recipe.weights
    bits = 2 if (w.symmetric and w.bits == 1) else w.bits  # 1-bit symmetric is written as +-1 codes
    return CtScheme(bits, w.group_size, w.symmetric, activation_spec(recipe.activations, "attention inputs"))


def export_replicas(artifact: Artifact) -> dict:
    """The artifact's export-replica section (hexq pack), or {}."""
    return artifact.manifest.get("export") or {}


def plan_layer(artifact: Artifact, row: int, target: int, table: torch.Tensor | None, acts: ActSpec | None,
               grid: tuple[int | None, bool] | None = None) -> LayerExport:
    """Every expert's source in a T-bit layer on `grid` (group size, symmetric; default the artifact's own expert
    grid): exact when the allocated code fits, else a GPTQ replica in the layer's scheme (the artifact's export
    replica, or the widest stored replica that fits), else RTN."""
    experts = artifact.manifest["experts"]
    own = (experts["group_size"], experts["symmetric"])
    grid = own if grid is None else grid
    scheme = CtScheme(target, grid[0], grid[1], acts)
    layer = artifact.moe_layers[row]
    extra = export_replicas(artifact)
    same_grid = (extra.get("bits"), extra.get("group_size"), extra.get("symmetric")) == (target, *grid)
    extra_here = set(extra.get("replicas", {}).get(str(layer), [])) if same_grid else set()
    columns = {b: i for i, b in enumerate(artifact.replica_bits)}

    def mse(e: int, bits: int) -> float | None:
        if table is None or bits not in columns:
            return None
        return float(table[e, columns[bits]])

    choices = []
    for e, b in enumerate(artifact.allocation[row]):
        fitting = [w for w in artifact.stored_bits(row, e) if w != b and scheme_fits(w, grid[1], target)]
        if b == 0:
            choices.append(ExpertChoice(e, 0, "zero", 0))
        elif grid == own and scheme_fits(b, grid[1], target):
            choices.append(ExpertChoice(e, b, "exact", b, mse(e, b), mse(e, b)))
        elif e in extra_here:  # the loss table measured the export replica only when it is on the own grid
            choices.append(ExpertChoice(e, b, "export-replica", target, mse(e, b),
                                        mse(e, target) if grid == own else None))
        elif grid == own and fitting:
            choices.append(ExpertChoice(e, b, "replica", max(fitting), mse(e, b), mse(e, max(fitting))))
        else:
            choices.append(ExpertChoice(e, b, "rtn", target, mse(e, b), None))
    return LayerExport(layer, scheme, tuple(choices))


def vllm_grid(artifact: Artifact) -> tuple[int | None, bool]:
    """The expert grid of a vLLM export: the artifact's own when vLLM's fused MoE takes it (symmetric; groups of 32,
    64, 128 or channels), else its export replicas' (calibrate --export-target vllm, then pack)."""
    experts = artifact.manifest["experts"]
    if experts["symmetric"] and experts["group_size"] in (None, 32, 64, 128):
        return experts["group_size"], True
    extra = export_replicas(artifact)
    if not extra or extra.get("own_grid", True):
        raise HexqError(f"{artifact.path}: its experts are on a grid vLLM's fused MoE does not take (group "
                        f"{experts['group_size']}, {'symmetric' if experts['symmetric'] else 'asymmetric'}) and it "
                        "keeps no vLLM replicas; calibrate with --export-target vllm (or recipe experts-vllm) and "
                        "pack with --bank export")
    return extra["group_size"], extra["symmetric"]


def plan_export(artifact: Artifact, experts: str = "auto") -> list[LayerExport]:
    """One LayerExport per MoE layer; experts: auto | w4 | w8 on the artifact's own grid, or vllm (4 bits on the
    grid vLLM's fused MoE takes; see vllm_grid)."""
    if experts not in EXPERT_MODES:
        raise HexqError(f"unknown experts scheme {experts!r}; choose one of {', '.join(EXPERT_MODES)}")
    recipe = recipe_from_dict(artifact.manifest["recipe"])
    acts = activation_spec(recipe.expert_activations, "routed experts")
    table = artifact.tensor(STATS_SHARD, "loss_table").float() if "loss_table" in artifact.keys(STATS_SHARD) \
        else None
    grid = vllm_grid(artifact) if experts == "vllm" else None
    plans = []
    for row in range(len(artifact.moe_layers)):
        rows_table = None if table is None else table[row]
        if experts == "w8":
            plans.append(plan_layer(artifact, row, 8, rows_table, acts))
            continue
        four = plan_layer(artifact, row, 4, rows_table, acts, grid)
        if experts == "auto" and any(c.source == "rtn" for c in four.choices):
            four = plan_layer(artifact, row, 8, rows_table, acts)
        plans.append(four)
    return plans


# ------------------------------------------------------------------------------------------ tensors of one layer


def split_rows(weight: CtWeight, at: int) -> tuple[CtWeight, CtWeight]:
    """gate_up's [2I, H] codes as (gate [I, H], up [I, H]): every tensor of a CtWeight is per output row."""
    parts = [t.split([at, t.shape[0] - at]) if t is not None else (None, None)
             for t in (weight.codes, weight.scale, weight.zero)]
    return CtWeight(parts[0][0], parts[1][0], parts[2][0]), CtWeight(parts[0][1], parts[1][1], parts[2][1])


def expert_weight(artifact: Artifact, row: int, choice: ExpertChoice, projection: str, scheme: CtScheme) -> CtWeight:
    """One projection of one expert in the layer's scheme, from the source `choice` names."""
    shape = artifact.expert_shape(projection)
    symmetric = (export_replicas(artifact)["symmetric"] if choice.source == "export-replica"
                 else artifact.manifest["experts"]["symmetric"])
    if choice.source == "zero":
        return zero_weight(shape, scheme, torch.device("cpu"))
    if choice.source == "rtn":
        return rtn_weight(dequantize_packed(artifact.packed_expert(row, choice.expert, choice.allocated,
                                                                   projection)), scheme)
    if choice.source == "export-replica":
        shard, prefix = export_shard(artifact.moe_layers[row]), replica_key(choice.expert, choice.bits, projection)
        packed = PackedWeight(artifact.tensor(shard, f"{prefix}.codes"), artifact.tensor(shard, f"{prefix}.scale"),
                              artifact.tensor(shard, f"{prefix}.zero"), choice.bits, shape)
    else:
        packed = artifact.packed_expert(row, choice.expert, choice.bits, projection)
    weight = retarget(packed, symmetric, scheme)
    if weight is None:
        raise HexqError(f"{artifact.path}: expert {choice.expert} of layer {artifact.moe_layers[row]} "
                        f"({projection}, {choice.bits} bits) has no exact {scheme.name} form (its zero points are "
                        "not on the expected grid); the artifact may be corrupt")
    return weight


def quantized_module_weight(artifact: Artifact, name: str, bits: int, shape: tuple[int, int],
                            scheme: CtScheme) -> CtWeight:
    """A quantized dense linear (weight name `name`) in the dense scheme, bit-identical."""
    shard = dense_shard(int(name.split(".")[2]))
    packed = PackedWeight(artifact.tensor(shard, f"{name}.codes"), artifact.tensor(shard, f"{name}.scale"),
                          artifact.tensor(shard, f"{name}.zero"), bits, shape)
    weight = retarget(packed, scheme.symmetric, scheme)
    if weight is None:
        raise HexqError(f"{artifact.path}: {name} ({bits} bits) has no exact {scheme.name} form")
    return weight


# ------------------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class WritePlan:
    """Every checkpoint tensor (in writing order) and how the modules are quantized, before anything is read."""

    specs: dict[str, tuple[torch.dtype, tuple]]
    groups: dict[CtScheme, list[str]]
    layers: list[LayerExport]
    dense: CtScheme


def _header_specs(artifact: Artifact, shard: str) -> dict[str, tuple[torch.dtype, tuple]]:
    from safetensors import safe_open

    with safe_open(str(artifact.verify(shard)), framework="pt") as handle:
        out = {}
        for key in handle.keys():
            piece = handle.get_slice(key)
            out[key] = (getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                                        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                                        "U8": "uint8", "BOOL": "bool"}[piece.get_dtype()]),
                        tuple(piece.get_shape()))
    return out


def _dense_keys(artifact: Artifact, shard: str, quantized: dict[str, int]) -> tuple[dict, list[str]]:
    """(stored plain tensors {key: spec}, quantized weight names) of one dense shard."""
    plain, modules = {}, []
    for key, spec in _header_specs(artifact, shard).items():
        if key.endswith(".act_range") or any(key == f"{name}.{part}" for name in quantized
                                             for part in ("codes", "scale", "zero")):
            continue
        plain[key] = spec
    modules = [name for name in quantized if f"{name}.codes" in artifact.keys(shard)]
    return plain, modules


def make_write_plan(artifact: Artifact, streamed, layers: list[LayerExport], adapter: MoEAdapter) -> WritePlan:
    dense = dense_scheme(artifact)
    quantized = artifact.manifest["dense"]["quantized_linears"]
    specs: dict[str, tuple[torch.dtype, tuple]] = {}
    groups: dict[CtScheme, list[str]] = {}
    top = _header_specs(artifact, TOP_SHARD)
    first = [key for key in top if key.startswith("model.embed_tokens")]
    specs |= {key: top[key] for key in first}
    by_layer = {plan.layer: plan for plan in layers}
    shapes = {p: artifact.expert_shape(p) for p in PROJECTIONS}
    inner = shapes["gate_up"][0] // 2
    for index in range(artifact.num_layers):
        plain, modules = _dense_keys(artifact, dense_shard(index), quantized)
        for key, spec in plain.items():
            specs[hub_name(key, adapter)] = spec
        for name in modules:
            shape = tuple(streamed.model.get_parameter(name).shape)
            module = hub_name(name.removesuffix(".weight"), adapter)
            specs |= module_specs(module, shape, dense)
            groups.setdefault(dense, []).append(module)
        plan = by_layer.get(index)
        if plan is not None:
            for e in range(artifact.num_experts):
                gate, up, down = expert_modules(index, e, adapter)
                for module, shape in ((gate, (inner, shapes["gate_up"][1])), (up, (inner, shapes["gate_up"][1])),
                                      (down, shapes["down"])):
                    specs |= module_specs(module, shape, plan.scheme)
    specs |= {key: spec for key, spec in top.items() if key not in first}
    for scheme in {plan.scheme for plan in layers}:
        groups.setdefault(scheme, []).append(
            experts_target([plan.layer for plan in layers if plan.scheme == scheme], adapter))
    return WritePlan(specs, groups, layers, dense)


def write_layer(artifact: Artifact, streamed, writer: ShardedWriter, index: int, plan: WritePlan,
                adapter: MoEAdapter) -> None:
    """Layer `index`'s tensors into the writer: dense part, then every routed expert, one at a time."""
    quantized = artifact.manifest["dense"]["quantized_linears"]
    shard = dense_shard(index)
    plain, modules = _dense_keys(artifact, shard, quantized)
    for key in plain:
        writer.write(hub_name(key, adapter), artifact.tensor(shard, key))
    for name in modules:
        shape = tuple(streamed.model.get_parameter(name).shape)
        weight = quantized_module_weight(artifact, name, quantized[name], shape, plan.dense)
        for key, tensor in module_tensors(hub_name(name.removesuffix(".weight"), adapter), weight,
                                          plan.dense).items():
            writer.write(key, tensor)
    layer = next((p for p in plan.layers if p.layer == index), None)
    if layer is None:
        return
    row = artifact.moe_layers.index(index)
    inner = artifact.expert_shape("gate_up")[0] // 2
    for choice in layer.choices:
        gate_up = expert_weight(artifact, row, choice, "gate_up", layer.scheme)
        down = expert_weight(artifact, row, choice, "down", layer.scheme)
        gate, up = split_rows(gate_up, inner)
        for module, weight in zip(expert_modules(index, choice.expert, adapter), (gate, up, down), strict=True):
            for key, tensor in module_tensors(module, weight, layer.scheme).items():
                writer.write(key, tensor)


def write_export(artifact: Artifact, folder: Path, experts: str = "auto", shard_bytes: int = DEFAULT_SHARD_BYTES,
                 progress: Progress | None = None) -> WritePlan:
    """Write the checkpoint into `folder` (an empty folder: the caller publishes it)."""
    from hexq.runtime.model import artifact_config
    from hexq.streaming import StreamedModel

    config = artifact_config(artifact)
    streamed = StreamedModel(config, artifact, torch.device("cpu"))  # the skeleton, for shapes only
    adapter = streamed.adapter
    plan = make_write_plan(artifact, streamed, plan_export(artifact, experts), adapter)
    writer = ShardedWriter(folder, plan.specs, shard_bytes)
    try:
        top = [key for key in artifact.keys(TOP_SHARD)]
        for key in top:
            if key.startswith("model.embed_tokens"):
                writer.write(key, artifact.tensor(TOP_SHARD, key))
        for index in range(artifact.num_layers):
            write_layer(artifact, streamed, writer, index, plan, adapter)
            if progress:
                progress("write", index + 1, artifact.num_layers)
        for key in top:
            if not key.startswith("model.embed_tokens"):
                writer.write(key, artifact.tensor(TOP_SHARD, key))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    data = json.loads((artifact.verify("config.json")).read_text())
    data["quantization_config"] = quantization_config(plan.groups)
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    from hexq.artifact.pack import MODEL_FILES

    for name in MODEL_FILES:
        if name != "config.json" and name in artifact.files:
            (folder / name).write_bytes(artifact.verify(name).read_bytes())
    return plan


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
    unread_keys: list[str] = field(default_factory=list)


class _Accumulator:
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

    from hexq.streaming import ExpertCompute, LoadedLayer, StreamedModel, expert_chunk

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
    from hexq.calib.pipeline import open_model
    from hexq.data import eval_text, tokenize
    from hexq.eval.perplexity import make_windows
    from hexq.runtime.model import artifact_model
    from hexq.streaming import full_precision_plan, stream_layers

    device = torch.device("cpu")
    adapter = adapter_for(artifact.manifest["model"]["model_type"])
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
        shapes = {"model.norm.weight": tuple(exported.model.model.norm.weight.shape),
                  "lm_head.weight": tuple(exported.model.lm_head.weight.shape)}
        _same_head({name: streamed.source for name, (streamed, _p) in models.items()}, shapes)
        served_acc, fp_acc = _Accumulator(), _Accumulator()
        with exported.parts("model.norm", "lm_head"):
            norm, head = exported.model.model.norm, exported.model.lm_head
            for index, batch in enumerate(ids.split(batch_size)):
                targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -1)], dim=1).reshape(-1)
                states = {name: norm(store[index]).reshape(-1, store[index].shape[-1])
                          for name, store in hidden.items()}
                step = max(1, LOGIT_ELEMENTS // head.weight.shape[0])  # positions whose logits fit the bound
                for start in range(0, targets.shape[0], step):
                    chunk = slice(start, start + step)
                    logits = {name: head(s[chunk]).float() for name, s in states.items()}
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


# ------------------------------------------------------------------------------------------ the command


@dataclass(frozen=True)
class ExportSummary:
    out: Path
    layers: list[LayerExport]
    dense: CtScheme
    check: CheckResult | None
    files_bytes: int
    seconds: float


def source_model(artifact: Artifact, given: Path | None) -> tuple[Path | None, str]:
    """The artifact's full-precision source checkpoint if it is still there and unchanged, and why not if not."""
    from hexq.calib.store import model_fingerprint

    recorded = artifact.manifest.get("provenance", {}).get("model_path")
    path = given if given is not None else (Path(recorded) if recorded else None)
    if path is None:
        return None, "the artifact does not record its source checkpoint (pass --source)"
    if not path.is_dir():
        if given is not None:
            raise HexqError(f"--source {given} is not a folder")
        return None, f"the source checkpoint {path} is gone"
    if model_fingerprint(path) != artifact.manifest["provenance"]["model_sha256"]:
        if given is not None:
            raise HexqError(f"--source {given} is not the checkpoint the artifact was made from (weights hash "
                            "differs)")
        return None, f"the source checkpoint {path} changed since the artifact was made"
    return path, "compared"


def export_artifact(path: str | Path, out: str | Path, experts: str = "auto", force: bool = False,
                    source: Path | None = None, windows: int = 8, seqlen: int = 256, data: str = "austen",
                    check: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Progress | None = None) -> ExportSummary:
    """Write the artifact at `path` as a compressed-tensors checkpoint in `out` (hexq.outputs rules: a temporary
    sibling renamed into place only after the check passed), and check it (see the module docstring)."""
    from hexq.outputs import output_folder

    started = time.time()
    artifact = Artifact(path)
    fp_path, note = source_model(artifact, source)
    inputs = [artifact.path] + ([fp_path] if fp_path is not None else [])
    with output_folder(out, kind="checkpoint", force=force, inputs=inputs) as folder:
        plan = write_export(artifact, folder, experts, shard_bytes, progress)
        result = None
        if check:
            projected = any(layer.projected for layer in plan.layers)
            result = check_export(artifact, folder, windows, seqlen, data, fp_path, projected=projected,
                                  progress=progress)
            if fp_path is None:
                result = CheckResult(**{**result.__dict__, "full_precision_note": note})
        report = export_report(artifact, plan, result)
        (folder / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if result is not None and not result.passed:
            s = result.vs_served
            raise HexqError(f"export check failed: logits vs the served model relative L2 {s.rel_l2:.3g}, argmax "
                            f"agreement {s.argmax_agreement:.1%} (limit {result.limit}); nothing was written to "
                            f"{out}")
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return ExportSummary(Path(out), plan.layers, plan.dense, result, size, time.time() - started)


def export_report(artifact: Artifact, plan: WritePlan, result: CheckResult | None) -> dict:
    """What was written and what the check measured, as stored in hexq_export.json."""
    layers = []
    for layer in plan.layers:
        projected = layer.projected
        layers.append({
            "layer": layer.layer, "scheme": layer.scheme.name, "vllm": vllm_support(layer.scheme, experts=True),
            "exact_experts": sum(c.source == "exact" for c in layer.choices),
            "zero_experts": sum(c.source == "zero" for c in layer.choices),
            "projected": [asdict(c) for c in projected]})
    return {"artifact": str(artifact.path), "dense": {"scheme": plan.dense.name,
                                                      "vllm": vllm_support(plan.dense, experts=False)},
            "experts": layers, "check": None if result is None else asdict(result)}
