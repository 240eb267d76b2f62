"""Perplexity with the GPTQ protocol: tokenize the evaluation text once, cut it into non-overlapping
windows of `seqlen` tokens (the remainder is dropped), perplexity = exp(mean token NLL over all windows).
Each window predicts its tokens 2..seqlen from the ones before it, so a window holds seqlen-1 scored tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hexq.base.errors import HexqError
from hexq.model.folder import context_length


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean token negative log-likelihood (nats)
    seqlen: int
    windows: int
    tokens_scored: int  # windows * (seqlen - 1)
    tokens_available: int  # length of the tokenized text


def make_windows(token_ids: torch.Tensor, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, seqlen] from the start of the token stream (GPTQ protocol)."""
    if seqlen < 2:
        raise HexqError(f"window length must be at least 2, got {seqlen}")
    available = int(token_ids.numel()) // seqlen
    if available == 0:
        raise HexqError(f"text too short: {token_ids.numel()} tokens, need at least {seqlen} for one window")
    count = available if max_windows is None else min(available, max_windows)
    return token_ids[: count * seqlen].reshape(count, seqlen)


def window_nll_sums(model, windows: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of each window [n], computed in fp32."""
    device = next(model.parameters()).device
    ids = windows.to(device)
    logits = model(input_ids=ids, use_cache=False).logits.float()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return nll.reshape(ids.shape[0], -1).sum(dim=1).double().cpu()


@torch.no_grad()
def perplexity(model, token_ids: torch.Tensor, seqlen: int, max_windows: int | None = None, batch_size: int = 8,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` on a token stream; `progress(done, total)` is called after each batch."""
    limit = context_length(model.config)
    if limit and seqlen > limit:
        raise HexqError(f"window length {seqlen} exceeds the model's context of {limit} tokens")
    windows = make_windows(token_ids, seqlen, max_windows)
    total_nll = 0.0
    for start in range(0, windows.shape[0], batch_size):
        total_nll += float(window_nll_sums(model, windows[start : start + batch_size]).sum())
        if progress is not None:
            progress(min(start + batch_size, windows.shape[0]), windows.shape[0])
    scored = windows.shape[0] * (seqlen - 1)
    mean_nll = total_nll / scored
    return PerplexityResult(math.exp(mean_nll), mean_nll, seqlen, windows.shape[0], scored, int(token_ids.numel()))
