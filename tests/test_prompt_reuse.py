"""Prompt reuse (hexq.runtime.prefix): a sequence whose prompt begins with the previous prompt takes that beginning's
keys and values from the native step's cache, in whole prefill passes, and is then the sequence a fresh runtime
generates - the same logits bit for bit at every step - wherever the cache holds the prefill's values exactly."""

from __future__ import annotations

import pytest
import torch

from hexq.packed import triton as gpu
from hexq.packed.cpu import load_cpu_kernels
from hexq.runtime import engine
from hexq.runtime.engine import Runtime
from hexq.runtime.graph import GraphDecoder
from hexq.runtime.native import NativeDecoder
from hexq.runtime.prefix import reusable_positions
from tests.conftest import needs_kernels

CHUNK = 32  # prefill passes of 32 tokens, so that the tiny model's 128 positions hold several


def test_reusable_positions_are_whole_passes_of_the_common_prefix_short_of_the_last_token():
    previous = list(range(100, 196))
    assert reusable_positions(previous, previous + [7, 8], CHUNK) == 96  # 96 in common
    assert reusable_positions(previous, previous, CHUNK) == 64  # the last token is prefilled again: 95
    assert reusable_positions(previous, previous[:65], CHUNK) == 64
    assert reusable_positions(previous, previous[:40] + [1] + previous[41:], CHUNK) == 32
    assert reusable_positions(previous, [1] + previous[1:], CHUNK) == 0
    assert reusable_positions([], previous, CHUNK) == 0


STEPS = {"native": 12, "graph": 4}  # the CUDA graph step runs in Triton's CPU interpreter here: slow


@pytest.mark.parametrize(("decode", "dtype", "kv_cache", "reuses"), [
    pytest.param("native", "bf16", "f16", True, marks=needs_kernels(load_cpu_kernels())),
    pytest.param("native", "fp32", "f32", True, marks=needs_kernels(load_cpu_kernels())),
    pytest.param("native", "fp32", "f16", False, marks=needs_kernels(load_cpu_kernels())),
    pytest.param("graph", "fp32", "f16", True, marks=[pytest.mark.skipif(not gpu.available(), reason="no triton"),
                                                      *[pytest.mark.gpu] * torch.cuda.is_available()])])
def test_a_reused_prompt_gives_what_a_fresh_runtime_gives(packed_artifact, monkeypatch, decode, dtype, kv_cache,
                                                          reuses):
    """The second prompt shares 37 tokens with the first: 32 are reused, the rest prefilled in the passes a fresh
    sequence runs; its capacity is larger than the first sequence's, so the step's cache is allocated again around
    the kept positions. A float32 prefill in a float16 cache would not come back exact: nothing is reused there (the
    CUDA graph step's cache is float32 whatever --kv-cache says)."""
    monkeypatch.setattr(engine, "PREFILL_CHUNK", CHUNK)
    seen: list[torch.Tensor] = []
    pick = engine.next_token
    monkeypatch.setattr(engine, "next_token", lambda logits, *rest: seen.append(logits.clone()) or pick(logits, *rest))
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(1, 8192, (40,), generator=generator).tolist()
    second = first[:37] + torch.randint(1, 8192, (30,), generator=generator).tolist()
    steps = STEPS[decode]
    device = {"native": {}, "graph": {"device": "cuda" if torch.cuda.is_available() else "cpu", "kernels": "triton"}}
    with Runtime(packed_artifact, dtype=dtype, kv_cache=kv_cache, **device[decode]) as runtime:
        assert isinstance(runtime.native, NativeDecoder if decode == "native" else GraphDecoder), runtime.decode_path

        def generate(ids: list[int], fresh: bool) -> tuple[list[int], list[torch.Tensor], int]:
            if fresh:
                runtime.native.prompt = []
            seen.clear()
            return list(runtime.tokens(ids, steps)), list(seen), runtime.reused

        generate(first, fresh=True)
        assert runtime.native.prompt == first
        tokens, logits, reused = generate(second, fresh=False)
        assert reused == (32 if reuses else 0)
        want_tokens, want_logits, none = generate(second, fresh=True)
        assert none == 0
        _logits, past = runtime._next_logits(torch.tensor([first[:5]]), None)
        runtime.native.start(past, 5, 8)  # another sequence's keys and values: nothing of the last prompt is held
        assert runtime.native.prompt == []
    assert tokens == want_tokens
    assert len(logits) >= 3 and all(torch.equal(got, want) for got, want in zip(logits, want_logits, strict=True))
