"""Function-preserving activation-outlier injection, to evaluate smoothing on small models.

Large LLMs carry a few activation channels whose max|X| is 20-100x the median channel's; small trained models do
not (max/median 1.3-2.7 on hexq's probe model), so smoothing (paper 003 §III.B.1) has nothing to fix there. This
transform creates such channels without changing the model's function: for each norm it multiplies a few
seeded-random channels of the norm's affine weight (and bias) by `factor` and divides the matching input columns of
every weight reading that norm by `factor`. That is fold_scales with s = 1/factor on those channels, i.e. the
inverse of a smoothing step, so the full-precision logits are unchanged while the quantized model faces the
outliers real LLMs have.
"""

from __future__ import annotations

import math

import torch

from hexq.calib.fold import fold_scales, smoothing_groups
from hexq.model.adapters import MoEAdapter

from rtn import decoder_layers


@torch.no_grad()
def inject_outliers(model, adapter: MoEAdapter, channels_per_norm: int = 4, factor: float = 50.0,
                    seed: int = 0) -> dict[tuple[int, str], tuple[int, ...]]:
    """Scale `channels_per_norm` channels of every smoothing-group norm by `factor`, in place, function-preserving.

    Channels are drawn independently per (layer, group) from a generator seeded with `seed`. Returns
    {(layer_index, group_name): sorted channel indices} with group_name "attn_in" or "moe_in".
    """
    if channels_per_norm < 0:
        raise ValueError(f"channels_per_norm must be >= 0, got {channels_per_norm}")
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be finite and positive, got {factor}")
    generator = torch.Generator().manual_seed(seed)
    changed: dict[tuple[int, str], tuple[int, ...]] = {}
    for layer_index, layer in enumerate(decoder_layers(model)):
        for group in smoothing_groups(layer, adapter):
            if channels_per_norm > group.channels:
                raise ValueError(f"channels_per_norm {channels_per_norm} exceeds the {group.channels} channels of "
                                 f"layer {layer_index} {group.name}")
            picked = torch.randperm(group.channels, generator=generator, device="cpu")
            channels = picked[:channels_per_norm].sort().values
            s = torch.ones(group.channels, dtype=torch.float64, device="cpu")
            s[channels] = 1.0 / factor  # norm.weight / s = weight * factor; readers' columns * s = / factor
            fold_scales(group, s)
            changed[(layer_index, group.name)] = tuple(channels.tolist())
    return changed
