"""Prompt reuse: a sequence whose prompt begins with the previous sequence's prompt takes that beginning's keys and
values from the decode step's KV cache (the native step's, or the CUDA graph step's) instead of prefilling it again
(a chat's next turn re-sends the whole conversation; on a CPU its prefill is most of the turn's time).

Why only whole prefill passes of the previous prompt. `Runtime._prefill` runs a prompt in passes of PREFILL_CHUNK
tokens, each from the KV cache of the passes before it. Reusing a whole number of passes leaves the rest of the new
prompt in exactly the passes a fresh sequence would run, over exactly the keys and values a fresh prefill computes
(those of the previous prompt's prefill; its generated tokens' come from the decode step, in float32: not reused), so
the sequence is the one a fresh runtime would generate, bit for bit: what a server answers does not depend on the
requests before it. The copy into the decode step's cache and back must be exact for that: bfloat16 values in a float16
cache (away from float16's subnormal range, below ~6e-5, where a copy rounds) or anything in a float32 one.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def reusable_positions(previous: list[int], ids: list[int], chunk: int) -> int:
    """Positions at the start of `ids` a new sequence can take from the previous prompt: their common prefix, cut to
    whole passes of `chunk` tokens, and short of the last token (whose logits the prefill must compute)."""
    common = 0
    for held, wanted in zip(previous, ids[:-1], strict=False):
        if held != wanted:
            break
        common += 1
    return common - common % chunk


def exact_copy(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> bool:
    """Whether keys and values computed in `dtype` come back unchanged from a cache of `cache_dtype` (None: there
    is none)."""
    return cache_dtype == torch.float32 or (dtype == torch.bfloat16 and cache_dtype == torch.float16)


def prefix_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, positions: int, dtype: torch.dtype,
                 config) -> DynamicCache:
    """The transformers KV cache of the first `positions` positions of a decode step's cache ([layers, KV heads,
    capacity, head dim] keys and values) in `dtype`: what the prefill of the rest of a prompt continues from."""
    past = DynamicCache(config=config)
    for layer in range(k_cache.shape[0]):
        past.update(k_cache[layer, :, :positions][None].to(dtype), v_cache[layer, :, :positions][None].to(dtype),
                    layer)
    return past


def grown_cache(old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device, first: int
                ) -> torch.Tensor:
    """A decode step's cache [layers, KV heads, capacity, head dim] allocated anew, zeroed (a masked position's value
    is multiplied by probability 0, which NaN would survive), with the `first` positions of `old` (the reused
    prompt's) copied over."""
    cache = torch.zeros(shape, dtype=dtype, device=device)
    if first:
        cache[:, :, :first] = old[:, :, :first]
    return cache


def copy_prompt(k_cache: torch.Tensor, v_cache: torch.Tensor, past, first: int, positions: int) -> None:
    """Positions [first, positions) of a prefill's KV cache `past` into a decode step's caches; the assignment converts
    to the cache's dtype (bf16 -> float16 through float32, exact, then one rounding to nearest even, as kernels.h's
    float_to_half rounds the native step's own)."""
    for layer in range(k_cache.shape[0]):
        k_cache[layer, :, first:positions] = past.layers[layer].keys[0, :, first:positions]
        v_cache[layer, :, first:positions] = past.layers[layer].values[0, :, first:positions]
