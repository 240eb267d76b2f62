"""What a prefill pass allocates: grouped-query attention without repeated key-value heads, the routed rows computed
from the codes a window at a time, and the memory plan's bound on a pass (hexq.runtime.memory.prefill_scratch_nbytes)
checked against torch's own count of the pass's allocations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from transformers.integrations import sdpa_attention

import hexq.runtime.compute as compute
import hexq.runtime.engine as engine
from hexq.model.attention import attention_forward
from hexq.runtime.engine import Runtime
from hexq.runtime.memory import RETAINED, prefill_scratch_nbytes
from hexq.runtime.model import expert_quantizers

IDS = torch.randint(0, 8192, (48,), generator=torch.Generator().manual_seed(3))
PROMPT = torch.randint(0, 8192, (1024,), generator=torch.Generator().manual_seed(4))


class Grouped(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_grouped_attention_runs_fused_without_repeating_heads(dtype, monkeypatch):
    """A pass after the first (queries after cached positions, a boolean mask): the same bits as transformers' SDPA,
    from torch's fused kernel alone (no other backend allowed) and without repeat_kv."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 5, 16, generator=generator).to(dtype)
    key, value = (torch.randn(1, 2, 12, 16, generator=generator).to(dtype) for _ in range(2))
    mask = torch.ones(1, 1, 5, 12, dtype=torch.bool).tril(7)
    want, _ = sdpa_attention.sdpa_attention_forward(Grouped(), query, key, value, mask, scaling=0.25)

    def repeated(*_args):
        raise AssertionError("the key-value heads were repeated")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", repeated)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got, _ = attention_forward(Grouped(), query, key, value, mask, scaling=0.25)
    assert got.shape == (1, 5, 8, 16) and torch.equal(got, want)


def test_routed_rows_in_windows_give_the_same_bits(packed_artifact, monkeypatch):
    """Three experts' rows (5, 7 and 4 of them) computed from the codes FROM_CODES_ROWS at a time, windows of 3
    cutting through every expert's rows: the same bits as in one window."""
    with Runtime(packed_artifact, threads=1) as runtime:
        if runtime.compute.kernels is None:
            pytest.skip("no CPU kernels")
        bits = runtime.artifact.allocation[0]
        experts = [e for e in range(len(bits)) if bits[e]][:3]
        counts, batch, start = (5, 7, 4), [], 0
        for expert, count in zip(experts, counts, strict=True):
            weights = runtime.cache.get(0, expert, bits[expert])
            if runtime.compute.lays_out(weights):
                weights = runtime.cache.relayout(0, expert, runtime.compute.relaid)
            batch.append((weights, start, count))
            start += count
        hidden = batch[0][0].down.shape[0]
        x = torch.randn(start, hidden, generator=torch.Generator().manual_seed(5)).to(runtime.dtype)
        quantizers = expert_quantizers(runtime.artifact, 0)
        whole, windowed = (torch.full((start, hidden), float("nan")) for _ in range(2))
        runtime.compute._experts_from_codes(x, batch, whole, F.silu, *quantizers)
        monkeypatch.setattr(compute, "FROM_CODES_ROWS", 3)
        runtime.compute._experts_from_codes(x, batch, windowed, F.silu, *quantizers)
    assert not whole.isnan().any() and torch.equal(windowed, whole)


def peak_allocated(run) -> int:
    """Torch's count of the bytes allocated during run() at its peak (the profiler's allocation events)."""
    import tempfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def test_a_prefill_pass_allocates_within_the_plans_bound(mixed_artifact, monkeypatch):
    """The last pass of a 1,024-token prompt prefilled in passes of 512 tokens allocates at most what the plan
    holds for one pass (the bound over RETAINED), the rest of the scratch (loads, expansions), and the KV cache it
    grows (DynamicCache concatenates each layer's keys and values anew); counted by torch's allocator, not by the
    RSS. SDPA's math path (scores of heads x tokens x positions) allocates 5x the bound here."""
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 512)
    monkeypatch.setattr(engine, "context_length", lambda _config: 1024)  # the tiny model's own is 128
    with Runtime(mixed_artifact, threads=1, context=1024) as runtime:
        config, artifact = runtime.model.config, runtime.artifact
        _, past = runtime._prefill(PROMPT[None, :512], None, every=False)
        peak = peak_allocated(lambda: runtime._prefill(PROMPT[None, 512:], past, every=False))
        prefill = prefill_scratch_nbytes(config, artifact, 512, 1024, runtime.dtype, True, torch.get_num_threads())
        bound = runtime.plan.scratch_bytes - prefill + prefill // RETAINED + runtime.plan.kv_bytes
    assert 0 < peak <= bound, f"a pass allocated {peak} bytes; the plan holds {bound}"
