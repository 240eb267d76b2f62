"""hexq run computing from the packed codes: the same perplexity as `hexq eval` on every device and dtype, the
kernels' path in the stats, the packed cache's bytes, and the start-up self-check that refuses wrong numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hexq.algos.quant import QuantSpec, quantize
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.eval.perplexity import make_windows
from hexq.eval.run import runtime_perplexity
from hexq.model.layer_pass import stream_nll
from hexq.model.simulate import ActQuantizer
from hexq.packed import triton as gpu
from hexq.packed.cpu import available_paths, load_cpu_kernels
from hexq.packed.weight import pack_weight
from hexq.runtime.compute import Compute
from hexq.runtime.engine import Runtime
from hexq.runtime.model import artifact_model
from tests.conftest import DEVICES, INT16_PATH, from_codes, needs_kernels

from reference import stream_logits

KERNELS = load_cpu_kernels()
IDS = torch.randint(0, 8192, (260,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def eval_perplexity(packed_artifact):
    """`hexq eval` of the artifact (streamed, float32) on 5 windows of 52 tokens."""
    streamed, _, prepare = artifact_model(packed_artifact, torch.device("cpu"))
    return math.exp(float(stream_nll(streamed, make_windows(IDS, 52), 1, prepare).sum()) / (5 * 51))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("cache", ["packed", "packed-codes", "bf16"])
def test_run_matches_eval_on_every_device(packed_artifact, eval_perplexity, device, dtype, cache):
    """The check `hexq run` and `hexq eval` share: the served perplexity within 0.1% of the streamed evaluation, on
    every device this machine has, in both dtypes, from the codes, as the cost model picks, and from expanded
    weights."""
    with Runtime(packed_artifact, device=device, dtype=dtype, cache=cache.removesuffix("-codes"),
                 decode="transformers") as runtime:  # the native step would re-lay the experts at its start
        if cache == "packed-codes":
            from_codes(runtime)
        got, scored, _ = runtime_perplexity(runtime, IDS, 52, None)
        stats = runtime.stats()
        resident = [runtime.cache.get(row, expert, bits) for (row, expert), bits in runtime.cache.resident().items()]
        # what the pass computed is kept re-laid for the kernels (read once in the stored stream, never again)
        relaid = [not runtime.compute.lays_out(weights) for weights in resident]
    # on CUDA every expert is resident in the layers' packed arenas: the cache holds none
    assert (relaid or device != "cpu") and (all(relaid) or cache == "bf16" or device != "cpu" or KERNELS is None), \
        relaid.count(False)
    assert scored == 5 * 51 and abs(got / eval_perplexity - 1) <= 1e-3, (got, eval_perplexity)
    if device == "cpu" and KERNELS is not None and cache == "packed-codes":
        assert stats.kernel_path == KERNELS.path and stats.gemv_rows > 0 and stats.expanded_experts == 0


@pytest.fixture(scope="module")
def skipping_eval(skipping_artifact):
    """`hexq eval` of the artifact that skips experts: (perplexity, logits [5, 52, vocab]) on the 5 windows."""
    assert all(0 in row for row in Artifact(skipping_artifact).allocation)  # every layer skips some expert
    windows = make_windows(IDS, 52)
    streamed, _, prepare = artifact_model(skipping_artifact, torch.device("cpu"))
    nll = stream_nll(streamed, windows, 1, prepare)
    streamed, _, prepare = artifact_model(skipping_artifact, torch.device("cpu"))
    return math.exp(float(nll.sum()) / (5 * 51)), stream_logits(streamed, windows, prepare, 1)


# Relative L2 of the served logits against `hexq eval`'s on the skipping artifact, per cache. fp32: experts expanded
# to float32 and no kernels (kernels="torch": every dense linear expanded too), what the evaluation computes, so
# float32 noise (measured 0). From the codes, the kernels' int16 activation blocks (relative ~3e-5 per product) put
# an occasional activation on the other side of a W8A8 rounding boundary, which moves these logits by 1.6e-3
# (measured); as the cost model picks, either. Dropping a skipped expert's renormalised weight moves them by ~2%.
LOGIT_BOUNDS = {"fp32": 1e-3, "packed-codes": 5e-3, "packed": 5e-3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", list(LOGIT_BOUNDS))
def test_skipped_experts_are_served_as_eval_computes_them(skipping_artifact, skipping_eval, device, cache):
    """0-bit experts: `hexq run` gives a skipped expert's routing weight to the token's kept experts exactly as
    `hexq eval` does, on every device and cache: the perplexity within 0.1% (as test_run_matches_eval_on_every_device)
    and, since this random model's perplexity hardly moves whatever its experts do (losing the skipped experts' weight
    moves it by ~4e-5), the logits within LOGIT_BOUNDS."""
    want, want_logits = skipping_eval
    kernels = "torch" if cache == "fp32" and device == "cpu" else "auto"
    with Runtime(skipping_artifact, device=device, dtype="fp32", cache=cache.removesuffix("-codes"),
                 kernels=kernels) as runtime:
        if cache == "packed-codes":
            from_codes(runtime)
        got, _, _ = runtime_perplexity(runtime, IDS, 52, None)
        logits = runtime.forward(make_windows(IDS, 52).to(runtime.device)).logits.float().cpu()
        assert runtime.stats().skipped_slots > 0
    assert abs(got / want - 1) <= 1e-3, (got, want)
    assert float((logits - want_logits).norm() / want_logits.norm()) <= LOGIT_BOUNDS[cache]


@needs_kernels(KERNELS)
@pytest.mark.parametrize("quantizer", [None, ActQuantizer(8, False, True), ActQuantizer(8, True, False, -2.0, 5.0)])
def test_bf16_linears_from_the_codes_are_the_fp32_ones_rounded_once(quantizer):
    """From the codes, --dtype bf16 computes a packed linear exactly as fp32 does (the activation quantized in float32,
    as `hexq eval` and the native step quantize it), its output rounded to bf16 once: quantizing in bf16 arithmetic put
    activations on other codes (a 512 x 1024 W8A8 linear: 2.3e-3 from the float64 product instead of 1.7e-3)."""
    generator = torch.Generator().manual_seed(0)
    weight = pack_weight(*quantize(torch.randn(256, 512, generator=generator), QuantSpec(bits=8, group_size=None,
                                                                                         symmetric=False)))
    x = (torch.randn(8, 512, generator=generator) * 3 + 0.5).bfloat16()
    got, want = (Compute(torch.device("cpu"), dtype, KERNELS).linear(x.to(dtype), weight, quantizer)
                 for dtype in (torch.bfloat16, torch.float32))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


@needs_kernels(KERNELS)
@pytest.mark.parametrize("path", available_paths(KERNELS.library) if KERNELS else [])
def test_decoded_perplexity_matches_eval_on_every_path(packed_artifact, eval_perplexity, path, monkeypatch):
    """`hexq run --ppl --decode native`: every position after a window's first scored by the native decode step, with
    each path's own activation blocks (int8 in the SIMD paths' rows8 GEMVs), within the 0.1% of `hexq eval` that
    `hexq run` is held to; refused with one line where the native step does not serve the run."""
    monkeypatch.setenv("HEXQ_CPU_PATH", path)
    with Runtime(packed_artifact, dtype="fp32") as runtime:
        assert runtime.native is not None and runtime.compute.path == path
        got, scored, _ = runtime_perplexity(runtime, IDS, 52, None, decoded=True)
    assert scored == 5 * 51 and abs(got / eval_perplexity - 1) <= 1e-3, (got, eval_perplexity)
    with Runtime(packed_artifact, dtype="fp32", decode="transformers") as runtime:
        with pytest.raises(HexqError, match="native decode step does not serve"):
            runtime_perplexity(runtime, IDS, 52, 1, decoded=True)


@needs_kernels(KERNELS)
@pytest.mark.parametrize("path", available_paths(KERNELS.library) if KERNELS else [])
def test_every_cpu_path_serves_the_same_model(packed_artifact, eval_perplexity, path, monkeypatch):
    monkeypatch.setenv("HEXQ_CPU_PATH", path)
    with Runtime(packed_artifact, dtype="fp32") as runtime:
        got, _, _ = runtime_perplexity(from_codes(runtime), IDS, 52, 2)
        assert runtime.stats().kernel_path == path
    streamed, _, prepare = artifact_model(packed_artifact, torch.device("cpu"))
    want = math.exp(float(stream_nll(streamed, make_windows(IDS, 52, 2), 1, prepare).sum()) / (2 * 51))
    assert abs(got / want - 1) <= 1e-3


def test_decode_from_the_codes_tracks_the_exact_model(packed_artifact, monkeypatch):
    """Position by position (prefill) and token by token (the GEMV path of decode), the logits from the codes stay
    within float32-level noise of the exact mode (measured ~3e-5 relative; the int16 activation blocks round each
    input to 1/32767 of its block's range), except where an input of a W8A8 linear lands on a near tie of its 8-bit
    grid, which the two paths then round to neighbouring codes: one code step, 1e-3 to 3e-3 at that position and,
    through the KV cache, at later ones (on this random model with the bundled 2-bit ranges: 4 of the 12 prompt
    positions and the decode steps from the third on; the router's top-k agreed at every position, its margins
    >= 6e-3). How many positions that reaches moves with the calibration's grids, so at least a quarter of the
    positions are held to 1e-4 and every one to 1e-2: a wrong code, scale or zero point moves every position that
    reads it by more. On a path whose GEMVs read int16 blocks: the SIMD paths' rows8 GEMVs read int8 blocks, which
    put their own rounding (measured 1.5e-4 to 3.2e-3) on every position (their bounds: tests/test_packed_cpu.py;
    their perplexity: test_decoded_perplexity_matches_eval_on_every_path)."""
    if KERNELS is not None:
        monkeypatch.setenv("HEXQ_CPU_PATH", INT16_PATH)
    exact = Runtime(packed_artifact, dtype="fp32", cache="fp32", kernels="torch")
    served = from_codes(Runtime(packed_artifact, dtype="fp32"))
    try:
        ids = IDS[:12][None]
        want = exact.forward(ids).logits[0]
        got = served.forward(ids).logits[0]
        errors = [float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)]
        past_a = past_b = None
        for token in IDS[12:20].tolist():  # one token at a time with the KV cache: decode
            step = torch.tensor([[token]])
            a = exact.model(step, past_key_values=past_a, use_cache=True)
            b = served.model(step, past_key_values=past_b, use_cache=True)
            past_a, past_b = a.past_key_values, b.past_key_values
            errors.append(float((b.logits - a.logits).norm() / a.logits.norm()))
        assert sum(e <= 1e-4 for e in errors) >= len(errors) // 4 and max(errors) <= 1e-2, errors
        assert served.stats().gemv_rows > 0 or KERNELS is None
    finally:
        exact.close()
        served.close()


def test_packed_cache_holds_the_stored_bytes(packed_artifact):
    """The fast tier counts packed bytes: every expert at its allocation in ~bits/16 of its bf16 bytes."""
    with Runtime(packed_artifact, warm="none") as packed, Runtime(packed_artifact, warm="none", cache="bf16") as bf16:
        ratio = packed.plan.expert_bytes / bf16.plan.expert_bytes
        average = packed.artifact.average_bits
        # codes at the average width plus a float16 scale and zero per 32 weights (1 bit each), slots rounded to 64 B
        assert average / 16 < ratio < (average + 1) / 16 * 1.1
        sizes = [packed.source.sizes.slot_bytes[b] for b in sorted(packed.source.sizes.slot_bytes)]
        assert sizes == sorted(set(sizes)) and sizes[-1] < bf16.source.sizes.largest_slot


def test_self_check_refuses_wrong_numbers(packed_artifact, monkeypatch):
    """A computation that is off (here: every expert output doubled, as a wrong dequantization would be) stops the
    runtime at start-up with one line, instead of serving wrong perplexities."""
    original = Compute.experts

    def doubled(self, x, batch, y, act_fn, quantizers):
        original(self, x, batch, y, act_fn, quantizers)
        y.mul_(2.0)

    monkeypatch.setattr(Compute, "experts", doubled)
    with pytest.raises(HexqError, match="refusing to serve wrong numbers"):
        Runtime(packed_artifact)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="triton is not installed")
def test_gpu_path_serves_the_same_model(packed_artifact, eval_perplexity):
    """The CUDA path - every expert resident in one arena per layer, one Triton launch per projection, dense linears
    through the same kernel - on CUDA where there is one, else in Triton's CPU interpreter: the same perplexity."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with Runtime(packed_artifact, device=device, kernels="triton", dtype="fp32") as runtime:
        assert all(m.arena is not None for m in runtime.model.modules() if hasattr(m, "arena"))
        got, _, _ = runtime_perplexity(runtime, IDS, 52, 1)
        stats = runtime.stats()
        text, _ = runtime.generate("It is a truth", 2)
    streamed, _, prepare = artifact_model(packed_artifact, torch.device("cpu"))
    want = math.exp(float(stream_nll(streamed, make_windows(IDS, 52, 1), 1, prepare).sum()) / 51)
    assert abs(got / want - 1) <= 1e-3 and stats.kernel_path == "triton" and stats.cache.misses == 0
    assert text


SKIP_PREFIX = 12


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="triton is not installed")
def test_gpu_path_serves_skipped_experts_as_eval(skipping_artifact, skipping_eval):
    """The resident CUDA arena renormalises a skipped expert's routing weight on the device, as `hexq eval` does:
    the same logits within float32 noise (test_skipped_experts_are_served_as_eval_computes_them), and --stats counts
    the skipped slots."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the first SKIP_PREFIX tokens of the first window: causal, so their logits are the evaluation's first ones (a
    # whole window in Triton's CPU interpreter took 95 s)
    windows = make_windows(IDS, 52, 1)[:, :SKIP_PREFIX]
    with Runtime(skipping_artifact, device=device, kernels="triton", dtype="fp32") as runtime:
        assert all(m.arena is not None for m in runtime.model.modules() if hasattr(m, "arena"))
        logits = runtime.forward(windows.to(runtime.device)).logits.float().cpu()
        assert runtime.stats().skipped_slots > 0  # counted on the device, read once here
    want = skipping_eval[1][:1, :SKIP_PREFIX]
    assert float((logits - want).norm() / want.norm()) <= 1e-3


def test_cost_model_latencies_are_measured_once_and_kept(packed_artifact, tmp_path, monkeypatch):
    """The first runtime on a machine measures the latencies and keeps them; the next one reads them, so both make
    the same GEMV-or-expand choices and compute the same bits."""
    monkeypatch.setenv("HEXQ_CACHE_DIR", str(tmp_path))
    ids = IDS[:40][None]
    with Runtime(packed_artifact) as first:
        logits = first.forward(ids).logits
        profiles = first.compute.profiles
    kept = sorted((tmp_path / "profiles").glob("*.json")) if KERNELS is not None else []
    assert len(kept) == (2 if KERNELS is not None else 0)
    with Runtime(packed_artifact, fast_tier_bytes=first.source.sizes.largest_slot * 3) as second:
        assert second.compute.profiles == profiles
        assert torch.equal(second.forward(ids).logits, logits)


@needs_kernels(KERNELS)
def test_every_expert_reaches_the_kernels_in_their_layout(packed_artifact, monkeypatch):
    """Cache hits, fills and transient loads alike reach the GEMV re-laid for this CPU's path (rows8 or planes): one
    layout whatever is resident. On some paths two layouts' products agree to the bit (the AVX-512 GEMV from the
    stream and from rows8, at these shapes), so equal logits alone would not show a transient expert left in its
    stored layout."""
    seen = []
    original = Compute._experts_from_codes

    def recording(self, x, batch, *args):
        seen.extend((w.transient, [(m.layout, self.kernels.layout_for(m)) for m in (w.gate_up, w.down)])
                    for w, _, _ in batch)
        return original(self, x, batch, *args)

    monkeypatch.setattr(Compute, "_experts_from_codes", recording)
    with Runtime(packed_artifact, warm="none") as probe:
        one = probe.source.sizes.largest_slot
    with Runtime(packed_artifact, fast_tier_bytes=2 * one, prefetch=False) as runtime:
        from_codes(runtime).forward(IDS[None, :40])
        assert runtime.cache.stats.bypass_loads > 0
    assert {transient for transient, _ in seen} == {True, False}
    assert any(stored != "stream" for _, pairs in seen for stored, _ in pairs)  # this path re-lays these shapes
    assert all(stored == wanted for _, pairs in seen for stored, wanted in pairs)
