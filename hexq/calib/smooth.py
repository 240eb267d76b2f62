"""Smoothing groups of a decoder layer and folding smoothing factors into the model (paper 003 §III.B.1).

Smoothing rewrites W X as (W diag(s)) (diag(s)^-1 X) (eq. 1). In a pre-norm transformer the division by s is free:
it is folded into the affine weight (and bias) of the norm whose output X is, and the multiplication into the input
columns of every weight that reads that output. Every reader of a norm must take the same s, so smoothing works
on groups:

    attn_in: input_norm          -> the attention input projections (q/k/v; DeepSeek q_proj or q_a_proj, and
                                    kv_a_proj_with_mqa; q_b_proj and kv_b_proj read inner norms, not this one)
    moe_in:  post_attention_norm -> router weight, every routed expert's gate_up_proj [E, 2I, H],
                                    the shared expert's gate/up projections and Qwen2-MoE's shared_expert_gate;
                                    on dense layers (DeepSeek first_k_dense_replace, Qwen mlp_only_layers) the
                                    MLP's gate/up projections

Every weight here has the norm's channels on its last axis ([out, C] or fused [E, 2I, C]), so folding is one
broadcast multiply. The router and shared_expert_gate stay in full precision in hexq (see calib/rtn.py); they
still read the smoothed activations, so they are in the group with `quantized=False`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hexq.adapters import MoEAdapter
from hexq.errors import HexqError

ATTN_IN, MOE_IN = "attn_in", "moe_in"
# Input projections of a dense MLP (shared expert, or the MLP of a dense layer) in every supported family.
MLP_INPUTS = ("gate_proj", "up_proj")
# Further full-precision readers of the MoE input that the adapter does not name (Qwen2-MoE's sigmoid gate on the
# shared expert, a Linear H -> 1).
MOE_GATE_INPUTS = ("shared_expert_gate",)


@dataclass(frozen=True)
class SmoothingReader:
    """One parameter whose last axis reads the norm's output channels."""

    name: str  # path relative to the decoder layer, e.g. "mlp.experts.gate_up_proj"
    module: torch.nn.Module
    param: str  # attribute of `module` holding the parameter
    quantized: bool = True  # False: kept in full precision by hexq (router, shared-expert gate)

    @property
    def tensor(self) -> torch.nn.Parameter:
        return getattr(self.module, self.param)

    def matrix(self) -> torch.Tensor:
        """The parameter as [rows, C] (fused experts stacked), detached: the W of eq. 1."""
        tensor = self.tensor.detach()
        return tensor.reshape(-1, tensor.shape[-1])


@dataclass(frozen=True)
class SmoothingGroup:
    """A norm and every weight reading its output: they share one smoothing factor s [C]."""

    name: str  # ATTN_IN or MOE_IN
    norm: torch.nn.Module
    readers: tuple[SmoothingReader, ...]

    @property
    def channels(self) -> int:
        return self.norm.weight.shape[-1]

    def weights(self) -> list[torch.Tensor]:
        """Every reader as an [out, C] matrix, in reader order (the `weights` of algos.smoothing)."""
        return [reader.matrix() for reader in self.readers]

    def quantized(self) -> list[bool]:
        """Per reader: is its weight quantized (the `quantize_weights` flags of algos.smoothing)."""
        return [reader.quantized for reader in self.readers]


def _reader(layer: torch.nn.Module, path: str, param: str, quantized: bool = True) -> SmoothingReader | None:
    module = layer.get_submodule(path) if _has_submodule(layer, path) else None
    if module is None or not isinstance(getattr(module, param, None), torch.Tensor):
        return None
    return SmoothingReader(f"{path}.{param}", module, param, quantized)


def _has_submodule(layer: torch.nn.Module, path: str) -> bool:
    try:
        return isinstance(layer.get_submodule(path), torch.nn.Module)
    except AttributeError:  # get_submodule's way of saying "no such child"; also covers children set to None
        return False


def _group(layer: torch.nn.Module, name: str, norm_path: str, readers: list[SmoothingReader | None]) -> SmoothingGroup:
    if not _has_submodule(layer, norm_path):
        raise HexqError(f"decoder layer has no norm {norm_path!r}; check the model's adapter")
    norm = layer.get_submodule(norm_path)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise HexqError(f"norm {norm_path!r} has no per-channel affine weight to fold smoothing factors into")
    found = [reader for reader in readers if reader is not None]
    if not found:
        raise HexqError(f"no weight reading {norm_path!r} was found for smoothing group {name!r}")
    for reader in found:
        if reader.tensor.shape[-1] != weight.shape[0]:
            raise HexqError(f"{reader.name} has {reader.tensor.shape[-1]} input channels but {norm_path!r} "
                            f"outputs {weight.shape[0]}; the adapter names the wrong module")
    return SmoothingGroup(name, norm, tuple(found))


def smoothing_groups(layer: torch.nn.Module, adapter: MoEAdapter) -> list[SmoothingGroup]:
    """The two smoothing groups of one decoder layer: [attn_in, moe_in] (see the module docstring)."""
    attention = adapter.attention
    attn_readers = [_reader(layer, f"{attention}.{name}", "weight") for name in adapter.attention_inputs]

    moe = adapter.moe
    router, experts = f"{moe}.{adapter.router}", f"{moe}.{adapter.experts}"
    if _has_submodule(layer, router) and _has_submodule(layer, experts):
        moe_readers = [_reader(layer, router, "weight", quantized=False), _reader(layer, experts, "gate_up_proj")]
        if adapter.shared_expert:
            moe_readers += [_reader(layer, f"{moe}.{adapter.shared_expert}.{name}", "weight") for name in MLP_INPUTS]
        moe_readers += [_reader(layer, f"{moe}.{name}", "weight", quantized=False) for name in MOE_GATE_INPUTS]
    else:  # dense layer: a plain gated MLP in the MoE block's place
        moe_readers = [_reader(layer, f"{moe}.{name}", "weight") for name in MLP_INPUTS]

    return [_group(layer, ATTN_IN, adapter.input_norm, attn_readers),
            _group(layer, MOE_IN, adapter.post_attention_norm, moe_readers)]


def _rescale_(param: torch.Tensor, factor: torch.Tensor, divide: bool) -> None:
    """param <- param / factor (or * factor) along the last axis, in float64, written back in param's dtype."""
    wide = param.detach().double()
    factor = factor.to(device=param.device)
    param.copy_((wide / factor if divide else wide * factor).to(param.dtype))


@torch.no_grad()
def fold_scales(group: SmoothingGroup, s: torch.Tensor) -> None:
    """Fold smoothing factors s [C] (all > 0) into the model in place, leaving its full-precision function unchanged:
    norm.weight /= s and norm.bias /= s (LayerNorm), every reader's input columns *= s (eq. 1's W s and s^-1 X)."""
    s = s.detach().double()
    if s.shape != (group.channels,):
        raise ValueError(f"smoothing factors of shape {tuple(s.shape)} for a group of {group.channels} channels")
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError("smoothing factors must be finite and positive")
    _rescale_(group.norm.weight, s, divide=True)
    bias = getattr(group.norm, "bias", None)
    if isinstance(bias, torch.Tensor):  # LayerNorm (PhiMoE): the shift is part of the output that s divides
        _rescale_(bias, s, divide=True)
    for reader in group.readers:
        _rescale_(reader.tensor, s, divide=False)
