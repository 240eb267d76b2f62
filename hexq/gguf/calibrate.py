"""`hexq calibrate --export-target gguf`: for every routed expert, GPTQ replicas on llama.cpp's Q2_K and Q3_K grids
from the same Hessian (and Cholesky factor) as its replica bank, stored as the blocks the GGUF export copies.

Only projections whose rows are a multiple of 256 weights can be K-quants (hexq.algos.kquant); the others get none,
and the export gives their layers the 4-bit type.
"""

from __future__ import annotations

import torch

from hexq.algos.gptq import HessianFactor
from hexq.algos.kquant import KQUANTS, SUPER, KQuantResult, gptq_kquant, rtn_kquant
from hexq.gguf.blocks import encode_q2_k, encode_q3_k


def kquant_kinds(recipe, shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[str, ...]]:
    """{projection: K-quants} the recipe asks the bank to hold ({} unless experts.export_target is gguf)."""
    if recipe.experts.mode != "replicas" or recipe.experts.export_target != "gguf":
        return {}
    return {p: tuple(KQUANTS) for p, (_rows, cols) in shapes.items() if cols % SUPER == 0}


def kquant_blocks(result: KQuantResult, expert: int) -> torch.Tensor:
    """One expert's blocks [rows, row_bytes] of a K-quant result."""
    p = result.params
    if result.kind == "Q2_K":
        return encode_q2_k(result.codes[expert], p.sc[expert], p.m[expert], p.d[expert], p.dmin[expert])
    return encode_q3_k(result.codes[expert], p.sc[expert], p.d[expert])


def kquant_replicas(weights: torch.Tensor, hessians: torch.Tensor, factor: HessianFactor | None, setting,
                    kind: str) -> torch.Tensor:
    """The `kind` replicas of a chunk of experts' weights [n, rows, cols] as blocks [n, rows * row_bytes]: GPTQ on
    the K-quant grid with the bank's factor (RTN on that grid for an RTN recipe), the Hessian diagonal weighting the
    sub-block fits."""
    importance = torch.diagonal(hessians, dim1=1, dim2=2)
    if setting.method == "rtn" or factor is None:
        result = rtn_kquant(weights, importance, kind)
    else:
        result = gptq_kquant(weights, factor, importance, kind, setting.block_size)
    return torch.stack([kquant_blocks(result, j).reshape(-1) for j in range(weights.shape[0])]).cpu()
