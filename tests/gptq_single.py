"""GPTQ of one matrix at one width through hexq's batched code (gptq_bank with one expert and one width): what the
GPTQ tests check hexq's column loop with, against the reference implementation and brute force."""

from __future__ import annotations

import torch

from hexq.algos.gptq import GPTQResult, gptq_bank
from hexq.algos.hessian import HessianFactor, factorize_hessian
from hexq.algos.quant import QuantSpec


def gptq_quantize(W: torch.Tensor, H: torch.Tensor | None, spec: QuantSpec, *, block_size: int = 128,
                  damp: float = 0.01, act_order: str = "none", column_importance: torch.Tensor | None = None,
                  factor: HessianFactor | None = None, max_damp: float = 1.0) -> GPTQResult:
    """Quantize W [out, in] with GPTQ on the Hessian H [in, in] (2 X X^T summed over calibration tokens).

    gptq_bank with one expert and one width (grids and dtypes as there). A precomputed `factor`
    (factorize_hessian, one expert) replaces H, damp, act_order and column_importance, which are then not used.
    """
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D [out, in] matrix, got shape {tuple(W.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = W.shape[1]
    group = n if spec.group_size is None else spec.group_size
    if n % group:
        raise ValueError(f"in_features {n} is not a multiple of group_size {group}")
    if factor is None:
        if H is None:
            raise ValueError("gptq_quantize needs H or a precomputed factor")
        if H.shape != (n, n):
            raise ValueError(f"H must be [{n}, {n}] for W of shape {tuple(W.shape)}, got {tuple(H.shape)}")
        factor = factorize_hessian(H, damp=damp, act_order=act_order, column_importance=column_importance,
                                   max_damp=max_damp)
    elif factor.hinv_chol.shape != (1, n, n):
        raise ValueError(f"factor is for {factor.num_experts} experts x {factor.hinv_chol.shape[-1]} inputs, "
                         f"W has 1 x {n}")
    return gptq_bank(W[None], factor, [spec.bits], spec, block_size=block_size)[spec.bits].expert(0)
