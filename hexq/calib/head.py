"""The LM head quantized weight-only (the recipe's `head` section), after the last decoder layer: GPTQ (003 eq. 4-6)
with the Hessian of the head's input - the final norm's output over every calibration token, computed from the
quantized model's last-layer outputs like every other linear's - or RTN.

GPTQ's rows are independent once the inverse-Hessian factor exists, so the head ([vocab, hidden]: 151,936 x 2048
at Qwen3-30B-A3B's vocabulary) is quantized HEAD_ROWS rows at a time from one factor, each block upcast from the
stored dtype and bit-packed as it is made: neither a float32 head nor its unpacked codes exist at once. Blocks of
whole rows pack to whole bytes (rows x hidden x bits is a multiple of 8 for every hidden width a group divides),
so the blocks' packed codes joined are the head's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hexq.algos.quant import QuantMeta
from hexq.base.hidden import HiddenStore
from hexq.calib.capture import SiteStats
from hexq.calib.quantize import expert_factor, quantize_expert_chunk
from hexq.config.recipe import WeightQuant
from hexq.model.streaming import StreamedModel
from hexq.packed.weight import PackedWeight, pack_weight

HEAD_ROWS = 8192  # rows of the head quantized at once: ~64 MB of float32 at hidden 2048, x the GPTQ working set
HEAD_PREFIX = "linear.lm_head"  # its tensors in the calibration's head file (codes, scale, zero)

Progress = Callable[[str, int, int], None]


@torch.no_grad()
def head_statistics(streamed: StreamedModel, hidden: HiddenStore) -> SiteStats:
    """Hessian (2 sum x x^T), range and per-channel max of the head's input over every token of `hidden` (the last
    decoder layer's outputs, one entry per batch)."""
    stats = SiteStats.empty(streamed.config.hidden_size, streamed.device)
    with streamed.parts("model.norm"):
        norm = streamed.model.model.norm
        for batch in hidden:
            stats.add(norm(batch.to(streamed.device)))
    return stats


def quantize_rows(weight: torch.Tensor, stats: SiteStats | None, setting: WeightQuant,
                  progress: Progress | None = None) -> PackedWeight:
    """weight [rows, cols] (any float dtype) quantized by `setting`, HEAD_ROWS rows at a time from one factor
    (hexq.calib.quantize, as a routed expert's replica), as stored bytes. stats: the input's statistics (GPTQ needs
    its Hessian; None only with RTN)."""
    rows, cols = weight.shape
    hessian = None if stats is None else stats.hessian[None]
    channel_max = None if stats is None else stats.abs_max
    factor = None if setting.method == "rtn" else expert_factor(hessian, setting, channel_max)
    group = setting.group_size or cols
    parts = []
    for start in range(0, rows, HEAD_ROWS):
        block = weight[start:start + HEAD_ROWS].to(device=weight.device if stats is None else stats.hessian.device,
                                                   dtype=torch.float32)
        quantized, _report = quantize_expert_chunk(block[None], hessian, setting, (setting.bits,), channel_max,
                                                   factor=factor)
        codes, scale, zero = (t[0].cpu() for t in quantized[setting.bits])
        parts.append(pack_weight(codes, QuantMeta(scale, zero, group, setting.bits)))
        if progress:
            progress("head rows", min(start + HEAD_ROWS, rows), rows)
    return PackedWeight(*(torch.cat([getattr(p, name) for p in parts]) for name in ("codes", "scale", "zero")),
                        setting.bits, (rows, cols))


def quantize_head(streamed: StreamedModel, hidden: HiddenStore, setting: WeightQuant,
                  progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """The head quantized by `setting` from the last decoder layer's outputs `hidden`: its tensors for the
    calibration's head file (HEAD_PREFIX + .codes/.scale/.zero). A tied head is the embedding matrix."""
    stats = head_statistics(streamed, hidden) if setting.method == "gptq" else None
    with streamed.parts("lm_head", dtype=streamed.head_dtype()):
        packed = quantize_rows(streamed.model.lm_head.weight.detach(), stats, setting, progress)
    return packed.tensors(HEAD_PREFIX)
