"""Folding smoothing factors into the model: a decoder layer's smoothing groups and the fold (paper 003 §III.B.1;
the search for the factors is hexq.algos.smoothing).

Smoothing rewrites W X as (W diag(s)) (diag(s)^-1 X) (eq. 1). In a pre-norm transformer the division by s is free:
it is folded into the affine weight (and bias) of the norm whose output X is, and the multiplication into the input
columns of every weight that reads that output. Every reader of a norm must take the same s, so smoothing works
on groups, named by the family's adapter (hexq.model.adapters):

    attn_in: input_norm          -> the attention input projections (q/k/v; DeepSeek q_proj or q_a_proj, and
                                    kv_a_proj_with_mqa)
    q_a:     q_a_layernorm       -> q_b_proj    (DeepSeek multi-head latent attention with q_lora_rank)
    kv_a:    kv_a_layernorm      -> kv_b_proj   (DeepSeek multi-head latent attention)
    moe_in:  post_attention_norm -> router weight, every routed expert's gate_up_proj [E, 2I, H], the shared expert's
                                    gate/up projections and its gate (Qwen2-MoE's shared_expert_gate); on a dense
                                    layer (DeepSeek first_k_dense_replace, Qwen mlp_only_layers) the MLP's gate/up

Every weight here has the norm's channels on its last axis ([out, C] or fused [E, 2I, C]), so folding is one
broadcast multiply. A LayerNorm's bias (PhiMoE) is part of the output s divides, so it is divided too. The router
and shared_expert_gate stay in full precision in hexq (as in the RTN baseline, benchmarks/rtn.py); they still read
the smoothed activations, so they are in the group with `quantized=False`.

The other quantized linears (o_proj, every down projection) read no norm's output: there is no norm to fold s^-1
into, so they are never smoothed; `unsmoothed_linears` says so for the calibration's layer report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hexq.base.errors import HexqError
from hexq.calib.capture import quantized_linears
from hexq.model.adapters import ATTN_IN, MOE, MOE_IN, MoEAdapter, NormGroup

__all__ = ["ATTN_IN", "MOE_IN", "SmoothingGroup", "SmoothingReader", "fold_calibrated", "fold_scales",
           "smoothing_groups", "unsmoothed_linears"]

NO_NORM = "its input is not a norm's output: there is no norm to fold 1/s into"


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

    name: str  # ATTN_IN, MOE_IN, or an attention-internal group (DeepSeek "q_a", "kv_a")
    section: str  # the recipe's smoothing.groups entry selecting it ("attention" | "moe")
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


def _module(layer: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        module = layer.get_submodule(path)
    except AttributeError:  # get_submodule's way of saying "no such child"; also covers children set to None
        return None
    return module if isinstance(module, torch.nn.Module) else None


def _reader(layer: torch.nn.Module, path: str, param: str, quantized: bool = True) -> SmoothingReader | None:
    module = _module(layer, path)
    if module is None or not isinstance(getattr(module, param, None), torch.Tensor):
        return None
    return SmoothingReader(f"{path}.{param}", module, param, quantized)


def moe_group_spec(layer: torch.nn.Module, adapter: MoEAdapter) -> tuple[NormGroup, dict[str, tuple[str, bool]]]:
    """The post-attention group of this layer as a NormGroup, plus {reader path: (parameter, quantized)}: on a MoE
    layer the router, the fused experts, the shared expert's inputs and its gate; on a dense layer the MLP's inputs."""
    moe = adapter.moe
    router, experts = f"{moe}.{adapter.router}", f"{moe}.{adapter.experts}"
    params: dict[str, tuple[str, bool]] = {}
    if _module(layer, router) is not None and _module(layer, experts) is not None:
        params[router] = ("weight", False)
        params[experts] = ("gate_up_proj", True)
        if adapter.shared_expert:
            for name in adapter.dense_mlp_inputs:
                params[f"{moe}.{adapter.shared_expert}.{name}"] = ("weight", True)
        if adapter.shared_expert_gate:
            params[f"{moe}.{adapter.shared_expert_gate}"] = ("weight", False)
    else:  # dense layer: a plain gated MLP in the MoE block's place
        for name in adapter.dense_mlp_inputs:
            params[f"{moe}.{name}"] = ("weight", True)
    return NormGroup(MOE_IN, MOE, adapter.post_attention_norm, tuple(params)), params


def _affine_problem(norm: torch.nn.Module | None, path: str) -> str | None:
    """Why smoothing factors cannot be folded into this norm, or None when they can."""
    weight = getattr(norm, "weight", None) if norm is not None else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"norm {path!r} has no per-channel affine weight to fold 1/s into"
    return None


def _build(layer: torch.nn.Module, spec: NormGroup, params: dict[str, tuple[str, bool]]) -> SmoothingGroup | None:
    norm = _module(layer, spec.norm)
    readers = [_reader(layer, path, *params.get(path, ("weight", True))) for path in spec.readers]
    found = [reader for reader in readers if reader is not None]
    if norm is None or not found or _affine_problem(norm, spec.norm):
        return None
    for reader in found:
        if reader.tensor.shape[-1] != norm.weight.shape[0]:
            raise HexqError(f"{reader.name} has {reader.tensor.shape[-1]} input channels but {spec.norm!r} "
                            f"outputs {norm.weight.shape[0]}; the adapter names the wrong module")
    return SmoothingGroup(spec.name, spec.section, norm, tuple(found))


def _specs(layer: torch.nn.Module, adapter: MoEAdapter) -> list[tuple[NormGroup, dict]]:
    return [*((spec, {}) for spec in adapter.attention_groups), moe_group_spec(layer, adapter)]


def smoothing_groups(layer: torch.nn.Module, adapter: MoEAdapter) -> list[SmoothingGroup]:
    """The smoothing groups of one decoder layer, attention groups first and moe_in last (see the module
    docstring); a group whose norm this config lacks (DeepSeek q_a without q_lora_rank) or that has no affine weight
    (see unsmoothed_linears) is left out."""
    groups = [group for spec, params in _specs(layer, adapter) if (group := _build(layer, spec, params))]
    names = {group.name for group in groups}
    if ATTN_IN not in names or MOE_IN not in names:
        missing = ATTN_IN if ATTN_IN not in names else MOE_IN
        raise HexqError(f"decoder layer has no {missing} smoothing group (a norm with a per-channel weight read by "
                        f"the adapter's linears); check the {adapter.model_type} adapter")
    return groups


def unsmoothed_linears(layer: torch.nn.Module, adapter: MoEAdapter) -> dict[str, str]:
    """{weight path: why no smoothing group covers it} for every quantized weight of the layer outside the groups
    (attention, shared expert, dense MLP and the routed experts' down_proj): the layer report's record of what
    smoothing cannot reach."""
    covered, blocked = set(), {}
    for spec, params in _specs(layer, adapter):
        # names, not modules: while a streamed layer is materialized its experts are an ExpertTap without weights
        names = {f"{path}.{params.get(path, ('weight',))[0]}" for path in spec.readers}
        if _build(layer, spec, params) is not None:
            covered |= names
            continue
        norm = _module(layer, spec.norm)
        problem = _affine_problem(norm, spec.norm)
        if norm is not None and problem:
            blocked |= dict.fromkeys(names, problem)
    weights = [f"{name}.weight" for name in quantized_linears(layer, adapter)]
    experts = f"{adapter.moe}.{adapter.experts}"
    if _module(layer, experts) is not None:
        weights += [f"{experts}.gate_up_proj", f"{experts}.down_proj"]
    return {name: blocked.get(name, NO_NORM) for name in weights if name not in covered}


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


def fold_calibrated(layer: torch.nn.Module, adapter: MoEAdapter, tensors: dict) -> None:
    """Fold a calibration layer's smoothing factors (`smooth.<group>`) into the materialized layer. A group without
    stored factors was not smoothed (a calibration written before hexq knew the group) and stays as it is."""
    for group in smoothing_groups(layer, adapter):
        s = tensors.get(f"smooth.{group.name}")
        if s is not None:
            fold_scales(group, s)
