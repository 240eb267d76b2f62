"""hexq run: the cached runtime computes exactly the resident model under any budget; stats and errors."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hexq.base.errors import HexqError
from hexq.eval.run import runtime_perplexity
from hexq.model.layer_pass import stream_nll
from hexq.runtime.engine import Runtime
from hexq.runtime.model import artifact_model
from hexq_cli.main import app

from reference import stream_logits

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
IDS = torch.randint(0, 8192, (40,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference_logits(mixed_artifact):
    """The artifact at its allocation as `hexq eval` computes it: streamed layer by layer, every expert resident."""
    streamed, _, prepare = artifact_model(mixed_artifact, torch.device("cpu"))
    return stream_logits(streamed, IDS[None], prepare)


# The exact mode: every matrix expanded in float32 by the torch path, as `hexq eval` computes it.
FP32 = {"dtype": "fp32", "cache": "fp32", "kernels": "torch"}
BF16 = {"cache": "bf16"}  # fixed-size slots: one expert's bytes do not depend on its width


@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("prefetch", [True, False])
def test_static_policy_logits_do_not_depend_on_the_budget(mixed_artifact, reference_logits, fraction, prefetch):
    """fp32 mode: the streamed eval's logits under every budget, warm start and cost model included."""
    probe = Runtime(mixed_artifact, **FP32)
    budget = max(int(fraction * probe.plan.expert_bytes), probe.cache.fast_tier.capacity // 16)
    probe.close()
    with Runtime(mixed_artifact, fast_tier_bytes=budget, prefetch=prefetch, **FP32) as runtime:
        logits = runtime.forward(IDS[None]).logits
        stats = runtime.stats()
    assert (logits - reference_logits).abs().max() <= 1e-5
    assert stats.peak_bytes <= budget
    if fraction < 1:  # the budget really was binding: experts were evicted or computed without a fill
        assert stats.cache.evictions + stats.cache.bypass_loads > 0


@pytest.fixture(scope="module")
def default_logits(mixed_artifact):
    """(all-resident logits of the default runtime: packed cache, kernels, bf16; bytes of every expert; of the
    largest slot)."""
    with Runtime(mixed_artifact, warm="none") as runtime:
        return runtime.forward(IDS[None]).logits, runtime.plan.expert_bytes, runtime.source.sizes.largest_slot


@pytest.mark.parametrize("options", [{"warm": "3"}, {"warm": "1", "prefetch": False}, {"warm": "2", "admission": False},
                                     {"mode": "ondemand"}])
@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_default_logits_are_bit_identical_across_budgets(mixed_artifact, default_logits, options, fraction):
    """The default runtime: the same bits under every budget, warm start, cost model and mode (hits, fills and
    transient loads all compute the same way)."""
    logits, total, one = default_logits
    with Runtime(mixed_artifact, fast_tier_bytes=max(int(fraction * total), one), **options) as runtime:
        assert torch.equal(runtime.forward(IDS[None]).logits, logits)


def test_load_on_demand_computes_the_same(mixed_artifact, reference_logits):
    with Runtime(mixed_artifact, mode="ondemand", **FP32) as runtime:
        logits = runtime.forward(IDS[None]).logits
        assert runtime.stats().peak_bytes == 0 and runtime.stats().cache.bypass_loads > 0
    assert (logits - reference_logits).abs().max() <= 1e-5


def test_generate_streams_and_reports(mixed_artifact):
    pieces = []
    with Runtime(mixed_artifact, fast_tier_bytes=None) as runtime:
        text, stats = runtime.generate("It is a truth universally", 8, pieces.append)
    assert "".join(pieces) == text and stats.generated_tokens == 8
    assert stats.ttft_seconds > 0 and stats.tpot_seconds > 0 and stats.tokens_per_second > 0
    assert 0 <= stats.prefetch.precision <= 1 and stats.prefetch.used > 0


def test_perplexity_matches_the_streamed_eval(mixed_artifact):
    from hexq.eval.perplexity import make_windows

    ids = torch.randint(0, 8192, (200,), generator=torch.Generator().manual_seed(2))
    streamed, _, prepare = artifact_model(mixed_artifact, torch.device("cpu"))
    want = math.exp(float(stream_nll(streamed, make_windows(ids, 50), 1, prepare).sum()) / (4 * 49))
    with Runtime(mixed_artifact, **FP32) as runtime:
        got, scored, _ = runtime_perplexity(runtime, ids, 50, None)
    assert scored == 4 * 49 and got == pytest.approx(want, rel=1e-5)


def test_errors(mixed_artifact):
    with pytest.raises(HexqError, match="minimum is"):
        Runtime(mixed_artifact, fast_tier_bytes=1000)
    with pytest.raises(ValueError, match="static"):
        Runtime(mixed_artifact, policy="fastest")
    with Runtime(mixed_artifact) as runtime, pytest.raises(HexqError, match="context"):
        runtime.generate("word " * 200, 10)


def test_cli_run(mixed_artifact, tmp_path):
    out = tmp_path / "run.json"
    result = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "The cat", "-m", "4", "--fast-tier", "100KB",
                                 "--stats", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["stats"]["generated_tokens"] == 4 and report["stats"]["peak_bytes"] <= 100_000
    assert runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "x", "--fast-tier", "ten"]).exit_code == 1
    bad = runner.invoke(app, ["run", str(mixed_artifact)])
    assert bad.exit_code == 1 and "exactly one of" in bad.output
    ppl = runner.invoke(app, ["run", str(mixed_artifact), "--ppl", "austen", "-n", "2", "-L", "32"])
    assert ppl.exit_code == 0 and "perplexity" in ppl.output


def test_cli_run_bad_inputs_and_interrupt(mixed_artifact, tmp_path, monkeypatch):
    not_artifact = runner.invoke(app, ["run", str(tmp_path), "--prompt", "x"])
    assert not_artifact.exit_code == 1 and "not a hexq artifact" in not_artifact.output
    policy = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "x", "--policy", "fastest"])
    assert policy.exit_code == 1 and "unknown precision policy 'fastest'" in policy.output
    long = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "word " * 200, "-m", "8"])
    assert long.exit_code == 1 and "context" in long.output

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Runtime, "generate", interrupted)
    stopped = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "x"])
    assert stopped.exit_code == 130 and "interrupted" in stopped.output


def test_prefill_admits_only_the_layer_share(mixed_artifact):
    """A prompt that touches every expert fills at most the cache's share per layer; the rest bypass the cache."""
    probe = Runtime(mixed_artifact, **BF16)
    one_expert = probe.source.sizes.largest_slot
    probe.close()
    with Runtime(mixed_artifact, fast_tier_bytes=4 * one_expert, prefetch=False, warm="none", **BF16) as runtime:
        runtime.forward(IDS[None])
        resident = runtime.cache.resident()
        stats = runtime.stats()
    assert runtime.state.layer_share == 2
    assert all(sum(1 for layer, _ in resident if layer == index) <= 2 for index in range(2))
    assert stats.cache.bypass_loads > 0


def peak_rss_of(code: str) -> int:
    """Peak RSS (bytes) of a fresh interpreter running `code` (its own getrusage, printed at exit)."""
    import subprocess
    import sys

    wrapped = f"{code}\nimport resource; print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    done = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, check=True)
    return int(done.stdout.split("PEAK")[-1])


def test_peak_rss_within_memory_over_the_interpreters_own(mixed_artifact):
    """`--memory` is one budget for the whole process: `hexq run`'s peak RSS stays within it over the baseline of an
    interpreter that has imported what the run must (the CLI, the runtime, the family's transformers model: ~160 MB of
    it torch._dynamo, which transformers' masking utilities import, Triton with it) and loaded the tokenizer. What is
    left is the plan (dense part, scratch, KV cache, experts) and ~40 MB the plan does not name (the model skeleton's
    Python objects, the start-up checks' tensors, allocator slack), which the 64 MB here must also cover. Caught (each
    tried): `import datasets` on the run's path (+83 MB), a stray 32 MB tensor. (A quantized head dequantized whole
    at start-up has its own test: tests/test_quantized_head.py.)"""
    memory = 64 * 2**20
    baseline = peak_rss_of("import hexq_cli.main, hexq.runtime.engine, hexq.runtime.native\n"
                           "import transformers.models.qwen3_moe.modeling_qwen3_moe\n"
                           "from transformers import AutoTokenizer\n"
                           f"AutoTokenizer.from_pretrained({str(mixed_artifact)!r})")
    run = peak_rss_of("import sys; from hexq_cli.main import main\n"
                      f"sys.argv = ['hexq', 'run', {str(mixed_artifact)!r}, '--memory', '{memory}', '--prompt', "
                      "'It is a truth universally acknowledged', '-n', '8']\n"
                      "try:\n    main()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code")
    assert run <= baseline + memory, f"peak {run / 2**20:.0f} MiB over a baseline of {baseline / 2**20:.0f} MiB"


def test_memory_is_one_budget_for_dense_scratch_and_experts(mixed_artifact):
    from hexq.runtime.memory import kv_position_bytes
    from hexq.runtime.model import dense_bytes

    with Runtime(mixed_artifact, warm="none", **BF16) as probe:
        dense, scratch, one = probe.plan.dense_bytes, probe.plan.scratch_bytes, probe.source.sizes.largest_slot
        assert dense == dense_bytes(probe.model)  # planned before materializing, exactly what was materialized
        kv = probe.plan.kv_bytes
        assert kv == probe.plan.context * kv_position_bytes(probe.model.config, torch.bfloat16, torch.float16) > 0
    minimum = dense + scratch + kv + one
    with pytest.raises(HexqError, match=f"below the minimum of .* \\({minimum} bytes\\)"):
        Runtime(mixed_artifact, memory_bytes=minimum - 1, **BF16)
    memory = minimum + 3 * one + one // 2
    with Runtime(mixed_artifact, memory_bytes=memory, **BF16) as runtime:
        assert runtime.plan.fast_tier_bytes == memory - dense - scratch - kv and runtime.slots == 4
        runtime.generate("It is a truth universally", 4)
        stats = runtime.stats().as_dict()
    assert stats["dense_bytes"] + stats["scratch_bytes"] + stats["kv_bytes"] + stats["fast_tier_bytes"] == memory
    assert stats["peak_bytes"] <= stats["fast_tier_bytes"] and stats["memory_bytes"] == memory
    with pytest.raises(HexqError, match="not both"):
        Runtime(mixed_artifact, fast_tier_bytes=10**6, memory_bytes=10**7)


@pytest.mark.parametrize("scheme", ["1", "2", "3"])
def test_warm_start_loads_the_placement(mixed_artifact, scheme):
    from hexq.algos.placement import frequency_placement, path_placement, two_stage_placement
    from hexq.artifact.format import STATS_SHARD
    from hexq.artifact.reader import Artifact

    artifact = Artifact(mixed_artifact)
    counts = artifact.tensor(STATS_SHARD, "router.counts").long()
    topk = artifact.tensor(STATS_SHARD, "router.topk").long()
    E = artifact.num_experts
    mask = {"1": path_placement(topk, E, 3), "2": frequency_placement(counts, 3),
            "3": two_stage_placement(topk, E, 3)}[scheme]
    with Runtime(mixed_artifact, warm="none", **BF16) as probe:
        one = probe.source.sizes.largest_slot
    with Runtime(mixed_artifact, fast_tier_bytes=6 * one, warm=scheme, **BF16) as runtime:  # 3 per layer
        resident = runtime.cache.resident()
        stats = runtime.stats()
    want = {(row, e) for row in range(mask.shape[0]) for e in range(E)
            if mask[row, e] and artifact.allocation[row][e]}
    assert set(resident) == want and stats.warm_experts == len(want)
    assert all(bits == artifact.allocation[row][e] for (row, e), bits in resident.items())
    assert stats.cache.hits == stats.cache.misses == 0  # counters start after the warm start


def test_warm_start_3_uses_the_placement_pack_stored(mixed_artifact):
    """With room for exactly pack's hot set, scheme 3 loads the manifest's placement as stored (not a recomputation)."""
    from hexq.artifact.reader import Artifact

    artifact = Artifact(mixed_artifact)
    placement = artifact.placement
    K, L = placement["hot_per_layer"], len(placement["hot"])
    with Runtime(mixed_artifact, warm="none", **BF16) as probe:
        one = probe.source.sizes.largest_slot
    with Runtime(mixed_artifact, fast_tier_bytes=K * L * one, warm="3", **BF16) as runtime:
        resident = set(runtime.cache.resident())
    want = {(row, e) for row, hot in enumerate(placement["hot"]) for e in hot if artifact.allocation[row][e]}
    assert placement["scheme"] == "two_stage" and want and resident == want


def test_a_corrupt_shard_found_by_the_prefetch_worker_is_one_line(mixed_artifact, tmp_path):
    import shutil

    bad = tmp_path / "bad.hexq"
    shutil.copytree(mixed_artifact, bad)
    shard = bad / "experts" / "layer_001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for warm in ("3", "none"):  # found by the warm start's loads, or by a look-ahead prefetch while decoding
        # a real process: what its threads print reaches stderr as a user would see it (no test runner capture)
        done = subprocess.run([sys.executable, "-m", "hexq_cli.main", "run", str(bad), "--prompt", "It is a truth",
                               "-m", "4", "--warm", warm], capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), HEXQ_DEBUG=""))
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines() == [lines[-1]]  # stderr holds the one error line, nothing else
        assert lines[-1].startswith("error: artifact file") and "layer_001.safetensors is corrupt" in lines[-1]


def test_cli_memory_option_and_stats(mixed_artifact, tmp_path):
    out = tmp_path / "run.json"
    result = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "The cat", "-m", "4", "--memory", "1GB",
                                 "--cache", "fp32", "--warm", "2", "--no-cost-model", "--stats", "--json",
                                 str(out)])
    assert result.exit_code == 0, result.output
    stats = json.loads(out.read_text())["stats"]
    assert stats["memory_bytes"] == 10**9 and stats["dense_bytes"] > 0 and stats["cache_format"] == "fp32"
    assert "compute" in result.output and stats["kernel_path"] in ("avx512", "avx2", "scalar", "torch")
    assert "memory plan" in result.output and "dense" in result.output
    small = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "x", "--memory", "100KB"])
    assert small.exit_code == 1 and "below the minimum" in small.output and len(small.output.splitlines()) == 1
    bad = runner.invoke(app, ["run", str(mixed_artifact), "--prompt", "x", "--cache", "fp8"])
    assert bad.exit_code == 1 and "--cache fp8" in bad.output and len(bad.output.splitlines()) == 1


def test_prefill_in_passes_of_prefill_chunk(mixed_artifact, monkeypatch):
    """A prompt is prefilled in forward passes of at most PREFILL_CHUNK tokens (a pass's activations are what the
    plan holds: hexq.runtime.memory.prefill_scratch_nbytes), with the logits, KV cache and every position's states
    of one pass: 11 tokens as 4 + 4 + 3 against one pass of 11, in the exact mode."""
    import hexq.runtime.engine as engine

    ids = IDS[None, :11]
    with Runtime(mixed_artifact, **FP32) as runtime:
        whole, whole_past = runtime._next_logits(ids, None)
        whole_states = runtime.window_states(ids[0])
        monkeypatch.setattr(engine, "PREFILL_CHUNK", 4)
        passes = []
        forward = runtime.model.model.forward

        def counted(input_ids, **kwargs):
            passes.append(input_ids.shape[1])
            return forward(input_ids, **kwargs)

        monkeypatch.setattr(runtime.model.model, "forward", counted)
        chunked, past = runtime._next_logits(ids, None)
        states = runtime.window_states(ids[0])
    assert passes == [4, 4, 3, 4, 4, 3]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, whole_states, rtol=1e-5, atol=1e-5)
    for layer, want in zip(past.layers, whole_past.layers, strict=True):
        torch.testing.assert_close(layer.keys, want.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values, want.values, rtol=1e-5, atol=1e-5)


def test_the_look_ahead_reads_the_next_layers_router_on_its_own_norm(tmp_path):
    """Layer l predicts layer l+1's experts from its own MoE input x_l = h / rms(h) * w_l (004 §4.4.1): rescaled by
    w_{l+1} / w_l it is what layer l+1's router would read if the residual did not move, h / rms(h) * w_{l+1}. With
    post-attention norms far from one (as trained models have), the prediction is that router's top-t on it."""
    from transformers import AutoTokenizer

    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import Budget, pack
    from hexq.runtime.experts import CachedExperts
    from tests.conftest import TOKENIZER_DIR, build_tiny_model, mixed_recipe

    model = build_tiny_model("qwen3_moe", seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:  # positive, spread over a decade
            layer.post_attention_layernorm.weight.copy_(10 ** (torch.rand(model.config.hidden_size,
                                                                          generator=generator) * 2 - 1))
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(tmp_path / "model")
    calibrate(tmp_path / "model", mixed_recipe(), "bundled", tmp_path / "cal")
    pack(tmp_path / "cal", tmp_path / "art.hexq", budget=Budget(avg_bits=3.0))
    with Runtime(tmp_path / "art.hexq", **FP32) as runtime:
        block = next(m for m in runtime.model.modules() if isinstance(m, CachedExperts) and m.layer == 0)
        layers = runtime.model.model.layers
        runtime.state.prefill = False
        agreed = 0
        for _ in range(8):
            h = torch.randn(1, 1, model.config.hidden_size, generator=generator)
            with torch.no_grad():
                block.look_ahead(layers[0].post_attention_layernorm(h))
                logits = block.next_router(layers[1].post_attention_layernorm(h))[0].reshape(-1)
            want = set(logits[: block.num_experts].topk(len(runtime.state.predicted[1])).indices.tolist())
            agreed += runtime.state.predicted[1] == want
    assert agreed == 8
