"""The mutation run: named semantic breakages of hexq, applied one at a time, each against the default-suite tests
that stand guard over it. A mutant is killed when those tests fail; one that survives is a bug the suite would let
land green, and makes this script exit 1.

    python scripts/mutants.py                 # every mutant of the test suite (~26 minutes on 2 cores)
    python scripts/mutants.py --gate          # and those the perplexity gate judges (~5 minutes more each)
    python scripts/mutants.py --only gptq-error-feedback-dropped rope-sign
    python scripts/mutants.py --list

Each mutant replaces one exact piece of source (which must occur exactly once, so a refactor that moves it is an
error here, not a silent pass) and runs `pytest -x` on its test files in a fresh process (C mutants rebuild the
kernels: the library is keyed by a hash of its sources). The source is restored in a `finally`, also on Ctrl-C, and
the script refuses to start on a file with uncommitted changes it would mutate, so nothing of yours can be lost.
Only default-suite tests are used (no `slow` ones): what `make test` runs is what must catch each breakage. The GGUF
mutant is caught by llama.cpp itself: set HEXQ_LLAMA_CPP_BIN (bash scripts/llama_cpp.sh prints it) or it survives (a
survivor whose tests only skipped says so, with the reason).
A gate mutant is judged by `scripts/ppl_gate.py` (part of `make test`) instead of pytest: killed when the gate fails,
the settings that failed named.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files or node ids of the default suite; () for a gate mutant
    path: str | None = None  # the CPU kernel path the mutated code runs on (not run where the CPU lacks it)
    gate: bool = False  # judged by the perplexity gate (scripts/ppl_gate.py), run with --gate only (~5 min each)


BAD_REQUESTS_TEST = "tests/test_serve.py::test_bad_requests_get_one_line_and_the_server_keeps_serving"
MUTANTS = [
    # ------------------------------------------------------------------ calibration math
    Mutant("block-rounding-keeps-the-worse-replicas", "hexq/algos/rounding.py",
           "        if not after < before:\n            return BlockRounding(dict(replicas), before, before)\n"
           "        tuned", "        if False:\n            return BlockRounding(dict(replicas), before, before)\n"
           "        tuned",
           ("tests/test_rounding.py",)),
    Mutant("a-rank-reads-every-expert-then-its-share", "hexq/model/checkpoint.py",
           "                tensor = part[rows.start:rows.stop]",
           "                tensor = part[:][rows.start:rows.stop].clone()",
           ("tests/test_streaming.py",)),
    Mutant("refit-scale-block-lower-triangle-zero", "hexq/algos/refit.py",
           "        ss[:, :, k + 1:, k] = ss[:, :, k, k + 1:]  # and the lower triangle",
           "        ss[:, :, k + 1:, k] = 0", ("tests/test_refit.py",)),
    Mutant("refit-offsets-schur-complement-dropped", "hexq/algos/refit.py",
           "    step_s = torch.linalg.solve(ss - c @ sm.mT, rs - (c @ rm[..., None])[..., 0])",
           "    step_s = torch.linalg.solve(ss, rs - (c @ rm[..., None])[..., 0])", ("tests/test_refit.py",)),
    Mutant("native-step-hits-not-handed-to-cache", "hexq/runtime/native.py",
           "        self.runtime.cache.touch(keys)", "        self.runtime.cache.touch(keys[:0])",
           ("tests/test_native_decode.py",)),
    Mutant("routing-scales-not-root-mean-square", "hexq/model/simulate.py",
           "        rms = weights.square().mean().sqrt()", "        rms = weights.square().mean()",
           ("tests/test_token_weights.py",)),
    Mutant("routing-weighted-down-hessian-unweighted", "hexq/calib/capture.py",
           "                x, mid = x * scale, mid * scale", "                x = x * scale",
           ("tests/test_token_weights.py",)),
    Mutant("routing-weighted-down-fit-cross-unweighted", "hexq/calib/down_fit.py",
           "                full, got = full * scale, got * scale", "                got = got * scale",
           ("tests/test_token_weights.py",)),
    Mutant("routing-weighted-loss-table-skips-replicas", "hexq/calib/loss_table.py",
           "references[j].split(rows), weight.split(rows), strict=True)",
           "references[j].split(rows), torch.ones_like(weight).split(rows), strict=True)",
           ("tests/test_token_weights.py",)),
    Mutant("routing-weighted-loss-table-skip-entry-unweighted", "hexq/calib/loss_table.py",
           "            skip_sse[expert] = squared_error(stand_in, reference, weight)",
           "            skip_sse[expert] = squared_error(stand_in, reference, torch.ones_like(weight))",
           ("tests/test_token_weights.py",)),
    Mutant("routing-weighted-rounding-batch-unweighted", "hexq/calib/rounding.py",
           "        mask[j, :len(rows)] = routed.scales(rows, slots).square() if weighted else 1",
           "        mask[j, :len(rows)] = 1", ("tests/test_token_weights.py",)),
    Mutant("routing-weights-not-passed-to-rounding", "hexq/calib/rounding.py",
           "setting.round_tokens, setting.routing_weighted)", "setting.round_tokens, False)",
           ("tests/test_token_weights.py",)),
    Mutant("routing-weights-not-passed-to-loss-table", "hexq/calib/pipeline.py",
           "                                 recipe.experts.routing_weighted)",
           "                                 False)", ("tests/test_token_weights.py",)),
    Mutant("spread-one-bit-static-groups-keep-min-max", "hexq/algos/gptq.py",
           "                lo, hi = torch.where(grids.spread, low, lo), torch.where(grids.spread, high, hi)",
           "                lo, hi = lo, hi", ("tests/test_gptq_bank.py",)),
    Mutant("spread-one-bit-dynamic-groups-keep-min-max", "hexq/algos/row_grids.py",
           "            lo, hi = torch.where(self.spread, low, lo), torch.where(self.spread, high, hi)",
           "            lo, hi = lo, hi", ("tests/test_gptq_bank.py",)),
    Mutant("float-zero-widths-lost-by-the-recipe", "hexq/config/recipe.py",
           "one_bit=self.one_bit, float_zero_bits=self.float_zero_bits)", "one_bit=self.one_bit)",
           ("tests/test_export.py",)),
    Mutant("float-zero-rows-keep-the-integer-grid", "hexq/algos/row_grids.py",
           "        return scale, torch.where(self.float_zero, zero, torch.round(zero))",
           "        return scale, torch.round(zero)", ("tests/test_gptq_bank.py",)),
    Mutant("clip-bits-keeps-the-worst-copy", "hexq/algos/gptq.py",
           "    best = losses.argmin(dim=0)  # [E, rows]", "    best = losses.argmax(dim=0)  # [E, rows]",
           ("tests/test_gptq_bank.py",)),
    Mutant("clip-bits-codes-without-their-scales", "hexq/algos/gptq.py",
           "    for t in (codes, scale, zero):", "    for t in (codes, zero):", ("tests/test_gptq_bank.py",)),
    Mutant("clip-bits-lost-by-the-chunk", "hexq/calib/quantize.py",
           "block_size=setting.block_size, fit_bits=setting.fit_bits, clip_bits=setting.clip_bits)",
           "block_size=setting.block_size, fit_bits=setting.fit_bits)",
           ("tests/test_low_bit_calibration.py",)),
    Mutant("block-rounding-frozen-matrices-move", "hexq/algos/rounding.py",
           "    if held is None:\n        return codes, inside", "    if True:\n        return codes, inside",
           ("tests/test_rounding.py",)),
    Mutant("block-rounding-gather-gradient-by-atomics", "hexq/calib/block_rounding.py",
           "x.index_select(0, token))", "x[token])", ("tests/test_rounding.py",)),
    Mutant("block-rounding-routing-weights-dropped", "hexq/calib/block_rounding.py",
           "return x.new_zeros(x.shape).index_add(0, token, y * weights)",
           "return x.new_zeros(x.shape).index_add(0, token, y)", ("tests/test_rounding.py",)),
    Mutant("gptq-error-feedback-dropped", "hexq/algos/gptq.py",
           "            Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].mT, err_blk, alpha=-1)",
           "            pass", ("tests/test_gptq.py",)),
    Mutant("hessian-damping-wrong", "hexq/algos/hessian.py",
           "    diag.add_(damp * diag_mean)  # in place: no dense identity",
           "    diag.add_(100 * damp * diag_mean)", ("tests/test_gptq.py",)),
    Mutant("replica-zero-point-off-by-one", "hexq/algos/quant.py",
           "        zero = torch.round(-wmin / scale)",
           "        zero = torch.round(-wmin / scale) + 1", ("tests/test_gptq.py", "tests/test_gptq_bank.py")),
    Mutant("smoothing-scale-inverted-on-the-norm", "hexq/calib/fold.py",
           "    _rescale_(group.norm.weight, s, divide=True)",
           "    _rescale_(group.norm.weight, s, divide=False)", ("tests/test_smoothing.py",)),
    # ------------------------------------------------------------------ packing
    Mutant("allocation-ignores-the-loss-table", "hexq/algos/allocation.py",
           "    return allocate(loss, bits, order, costs=list(bits), budget=avg_bit_budget(avg_bits, loss.shape[0]))",
           "    return allocate(torch.zeros_like(loss), bits, order, costs=list(bits), "
           "budget=avg_bit_budget(avg_bits, loss.shape[0]))", ("tests/test_allocation.py",)),
    Mutant("runtime-drops-the-skipped-weight", "hexq/runtime/experts.py",
           "        weights = served_weights(top_k_index, top_k_weights, bits > 0, self.num_experts)",
           "        weights = top_k_weights",
           ("tests/test_runtime_packed.py::test_skipped_experts_are_served_as_eval_computes_them",)),
    Mutant("skipped-weight-not-renormalised", "hexq/model/simulate.py",
           "    scale = torch.where(kept_mass > 0, total / kept_mass.masked_fill(kept_mass == 0, 1), "
           "torch.zeros_like(total))",
           "    scale = torch.where(kept_mass > 0, torch.ones_like(total), torch.zeros_like(total))",
           ("tests/test_skip.py",)),
    Mutant("manifest-checksum-not-verified", "hexq/artifact/reader.py",
           "        if actual != entry[\"sha256\"]:",
           "        if False:", ("tests/test_pack.py",)),
    Mutant("resume-reuses-another-recipe", "hexq/calib/store.py",
           "    if progress.get(\"fingerprint\") != fingerprint:\n        return None",
           "    if progress.get(\"fingerprint\", {}).get(\"model\") != fingerprint[\"model\"]:\n        return None",
           ("tests/test_killed_runs.py",)),
    # ------------------------------------------------------------------ export
    Mutant("gguf-rope-permutation-dropped", "hexq/export/gguf/arch.py",
           "    return index.transpose(1, 2).reshape(rows)",
           "    return index.reshape(rows)", ("tests/test_llama_cpp.py",)),
    Mutant("kl-divergence-the-other-way", "hexq/eval/divergence.py",
           "    kld = (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0)",
           "    kld = (log_q.exp() * (log_q - log_p)).sum(-1).clamp(min=0)", ("tests/test_divergence.py",)),
    Mutant("artifact-of-a-newer-format-read", "hexq/artifact/format.py",
           "    if not isinstance(version, int) or version > FORMAT_VERSION:", "    if not isinstance(version, int):",
           ("tests/test_pack.py",)),
    Mutant("ranks-split-by-expert-count", "hexq/calib/ranks.py",
           "(1.0 + TOKEN_COST * t / mean for t in tokens)", "(1.0 for t in tokens)",
           ("tests/test_distributed.py::test_expert_ranges_cover_every_expert_once_and_balance_the_cost",)),
    Mutant("serve-listens-on-every-interface", "cli/serve_command.py",
           '"interface).")] = "127.0.0.1",', '"interface).")] = "0.0.0.0",', ("tests/test_serve.py",)),
    Mutant("smoothing-picks-the-worst-exponent", "hexq/algos/smoothing.py",
           "    best = min(range(len(grid)), key=lambda i: (errors[i], i))  # ties -> smallest index -> smallest e",
           "    best = max(range(len(grid)), key=lambda i: (errors[i], i))  # ties -> smallest index -> smallest e",
           ("tests/test_smoothing.py",)),
    Mutant("cosine-depth-schedule-inverted", "hexq/algos/allocation.py",
           "(math.cos(math.pi * layer / (num_layers - 1)) + 1)", "(1 - math.cos(math.pi * layer / (num_layers - 1)))",
           ("tests/test_allocation.py",)),
    Mutant("free-allocation-spends-past-its-budget", "hexq/algos/allocation.py",
           "        low, high = (low, middle) if spend(pick(middle)) <= budget else (middle, high)",
           "        low, high = (low, middle) if spend(pick(middle)) <= 1.1 * budget else (middle, high)",
           ("tests/test_free_allocation.py",)),
    Mutant("perplexity-scores-each-token-against-itself", "hexq/eval/perplexity.py",
           "ids[:, 1:].reshape(-1), reduction", "ids[:, :-1].reshape(-1), reduction", ("tests/test_perplexity.py",)),
    Mutant("calibration-fingerprint-without-its-data", "hexq/calib/pipeline.py",
           '"data": tensor_fingerprint(windows.ids),', '"data": "",',
           ("tests/test_killed_runs.py::test_kill_9_during_calibrate_then_the_rerun_resumes",)),
    Mutant("export-check-always-passes", "hexq/export/check.py",
           '        passed = vs_served.rel_l2 <= limit["rel_l2"]\n', "        passed = True\n",
           ("tests/test_export.py",)),
    Mutant("export-check-ignores-unread-tensors", "hexq/export/check.py",
           "    unread = reader.unread()\n", "    unread = []\n",
           ("tests/test_export.py::test_a_tensor_no_module_reads_fails_the_check_by_name",)),
    Mutant("outputs-replace-a-folder-hexq-did-not-write", "hexq/base/outputs.py",
           "    if marker is None:\n        raise HexqError(f\"output {out} is not empty and was not written by hexq",
           "    if False:\n        raise HexqError(f\"output {out} is not empty and was not written by hexq",
           ("tests/test_outputs.py",)),
    Mutant("importance-without-the-routing-mass", "hexq/algos/importance.py",
           "    return alpha * share(counts) + (1.0 - alpha) * share(score_sums)", "    return share(counts)",
           ("tests/test_importance.py",)),
    Mutant("gptq-act-order-codes-left-permuted", "hexq/algos/gptq.py",
           "        codes = _rows(codes, torch.argsort(perm, dim=1))",
           "        codes = _rows(codes, perm)", ("tests/test_gptq_bank.py",)),
    Mutant("sizes-in-megabytes-read-as-mebibytes", "hexq/base/units.py", '"mb": 10**6,', '"mb": 2**20,',
           ("tests/test_io.py", "tests/test_cli.py")),
    Mutant("atomic-write-leaves-its-temporary", "hexq/base/io.py",
           "    except BaseException:\n        Path(tmp).unlink(missing_ok=True)\n        raise\n",
           "    except BaseException:\n        raise\n", ("tests/test_io.py",)),
    Mutant("calibration-windows-ignore-the-seed", "hexq/base/data.py",
           "    generator = torch.Generator(device=token_ids.device).manual_seed(seed)\n",
           "    generator = torch.Generator(device=token_ids.device)\n", ("tests/test_data.py",)),
    Mutant("calibration-windows-miss-the-text-end", "hexq/base/data.py",
           "    starts = torch.randint(0, total - seqlen, (n,)",
           "    starts = torch.randint(0, total - 2 * seqlen, (n,)",
           ("tests/test_data.py",)),
    Mutant("outputs-replace-another-kind-of-folder", "hexq/base/outputs.py",
           "    if marker.kind != kind:\n", "    if False:\n", ("tests/test_outputs.py",)),
    Mutant("path-scores-only-out-of-a-layer", "hexq/algos/placement.py",
           "        scores[1:] = torch.maximum(scores[1:], trans.amax(dim=1))  # into layer l+1\n", "",
           ("tests/test_placement.py",)),
    Mutant("two-stage-placement-skips-its-paths", "hexq/algos/placement.py",
           "    return first_k_mask(ranked(stage1.long(), counts), K)", "    return first_k_mask(ranked(counts), K)",
           ("tests/test_placement.py",)),
    Mutant("bank-of-a-policy-misses-its-widths", "hexq/pack/stage.py",
           "            widths |= wanted\n", "            widths |= set()\n",
           ("tests/test_policy_serving.py::test_a_policy_bank_holds_every_width_the_policy_asks_for",)),
    Mutant("a-later-setting-changes-old-fingerprints", "hexq/config/fingerprint.py",
           '                   ("experts", "weights", "clip_bits"): [], ("head", "clip_bits"): []}',
           "                   }",
           ("tests/test_recipe.py", "tests/test_calibrate.py")),
    Mutant("head-group-size-not-checked-against-the-model", "hexq/config/model_check.py",
           "    if head_group is not None and hidden_size % head_group:", "    if False:",
           ("tests/test_recipe.py", "tests/test_quantized_head.py")),
    # ------------------------------------------------------------------ the runtime
    Mutant("cache-serves-a-lower-width", "hexq/runtime/cache.py",
           "        if v is None or v.bits < bits:",
           "        if v is None:", ("tests/test_runtime_cache.py",)),
    Mutant("context-policy-widths-ignored", "hexq/runtime/policy.py",
           "        plan = self._static if self._plan is None else self._plan\n"
           "        return _widths_by_expert(plan[layer], indices)",
           "        plan = self._static\n        return _widths_by_expert(plan[layer], indices)",
           ("tests/test_policy.py",)),
    Mutant("online-policy-without-hysteresis", "hexq/runtime/policy.py",
           "            if h[hottest] <= (1 + self.margin) * h[weakest]:", "            if h[hottest] <= h[weakest]:",
           ("tests/test_policy.py",)),
    Mutant("look-ahead-queues-the-current-layer", "hexq/runtime/experts.py",
           "        layer = self.layer + 1\n        state.predicted[layer]",
           "        layer = self.layer\n        state.predicted[layer]",
           ("tests/test_runtime.py", "tests/test_runtime_cache.py")),
    Mutant("look-ahead-without-the-norm-ratio", "hexq/runtime/experts.py",
           "        ahead = hidden_states if self.norm_ratio is None else hidden_states * self.norm_ratio",
           "        ahead = hidden_states",
           ("tests/test_runtime.py::test_the_look_ahead_reads_the_next_layers_router_on_its_own_norm",)),
    Mutant("sampling-temperature-ignored", "hexq/runtime/sampling.py",
           "    probs = torch.softmax(logits.float().cpu() / sampling.temperature, -1)",
           "    probs = torch.softmax(logits.float().cpu(), -1)", ("tests/test_sampling.py",)),
    Mutant("sampling-seed-ignored", "hexq/runtime/sampling.py",
           "        return torch.Generator(device=\"cpu\").manual_seed(self.seed)",
           "        return torch.Generator(device=\"cpu\")", ("tests/test_sampling.py",)),
    Mutant("cache-evicts-the-most-recently-used", "hexq/runtime/cache.py",
           "        for victim, handle in self._lru.items():\n            if freed >= need:",
           "        for victim, handle in reversed(self._lru.items()):\n            if freed >= need:",
           ("tests/test_runtime_cache.py",)),
    Mutant("warm-start-loads-skipped-experts", "hexq/runtime/warm.py",
           "    chosen = mask & allowed\n", "    chosen = mask\n",
           ("tests/test_skip.py::test_the_warm_start_loads_no_skipped_expert_and_the_most_used_last",)),
    Mutant("warm-start-most-valuable-first", "hexq/runtime/warm.py",
           "    picks.sort(key=lambda t: (t[0], t[1], t[2]))  # least frequent first",
           "    picks.sort(key=lambda t: (-t[0], t[1], t[2]))  # least frequent first",
           ("tests/test_skip.py::test_the_warm_start_loads_no_skipped_expert_and_the_most_used_last",)),
    Mutant("usage-average-forgets-nothing", "hexq/runtime/cost.py",
           "    keep = (1.0 - 1.0 / horizon) ** tokens", "    keep = 1.0", ("tests/test_cost_model.py",)),
    Mutant("admission-ignores-what-it-evicts", "hexq/runtime/cost.py",
           "    return new_usage * new_load_seconds > sum(u * t for u, t in victims)",
           "    return new_usage * new_load_seconds > 0", ("tests/test_cost_model.py", "tests/test_runtime_cache.py")),
    Mutant("serve-token-ids-out-of-the-vocabulary-taken", "hexq/serve/app.py",
           "            if any(not 0 <= token < vocab for token in prompt):", "            if False:",
           ("tests/test_serve.py",)),
    Mutant("serve-chat-without-the-generation-prompt", "hexq/serve/app.py",
           "                                                     add_generation_prompt=True)",
           "                                                     add_generation_prompt=False)",
           ("tests/test_serve.py",)),
    Mutant("serve-usage-counts-the-prompt-wrong", "hexq/serve/app.py",
           '        return chunk(text, finish) | {"usage": usage(len(ids), completion_tokens, job.reused)}',
           '        return chunk(text, finish) | {"usage": usage(len(ids) + 1, completion_tokens, job.reused)}',
           ("tests/test_serve.py::test_the_openai_client_gets_what_hexq_run_gives",)),
    Mutant("memory-plan-forgets-the-kv-cache", "hexq/runtime/memory.py",
           "        fast_tier = memory_bytes - dense_bytes - scratch_bytes - kv_bytes\n",
           "        fast_tier = memory_bytes - dense_bytes - scratch_bytes\n", ("tests/test_memory_plan.py",)),
    Mutant("online-policy-hot-set-ignored", "hexq/runtime/policy.py",
           "        widths = torch.where(self.hot[layer], self.high_bits, self.low_bits)",
           "        widths = torch.where(self.hot[layer] & False, self.high_bits, self.low_bits)",
           ("tests/test_policy.py",)),
    Mutant("depth-policy-rank-ignored", "hexq/runtime/policy.py",
           "        high = rank < self.kept_slots(layer, k)", "        high = rank < k", ("tests/test_policy.py",)),
    Mutant("runtime-asks-another-width", "hexq/runtime/experts.py",
           "                weights = self.cache.get(self.layer, expert, width, fill=expert in admitted)",
           "                weights = self.cache.get(self.layer, expert, max(width, 3), fill=expert in admitted)",
           ("tests/test_policy_serving.py",)),
    # ------------------------------------------------------------------ the server and sampling
    Mutant("serve-api-key-not-checked", "hexq/serve/app.py",
           "        if self.api_key is not None and scope[\"path\"] not in OPEN_PATHS:",
           "        if False:", (BAD_REQUESTS_TEST,)),
    Mutant("serve-body-counted-only-by-its-header", "hexq/serve/app.py",
           "                    if received > self.max_body_bytes:",
           "                    if False:", (BAD_REQUESTS_TEST,)),
    Mutant("serve-generation-ignores-a-gone-client", "hexq/serve/worker.py",
           "            if job.cancelled.is_set():\n                reason = \"cancelled\"",
           "            if False:\n                reason = \"cancelled\"",
           ("tests/test_serve.py::test_a_client_gone_mid_stream_stops_its_generation",)),
    Mutant("serve-queue-unbounded", "hexq/serve/worker.py",
           "            if self.waiting >= self.max_queue:", "            if False:",
           ("tests/test_serve.py::test_past_the_queue_bound_requests_get_503",)),
    Mutant("serve-top-k-dropped", "hexq/serve/app.py",
           "request_body.top_p, max(request_body.top_k, 0), seed)", "request_body.top_p, 0, seed)",
           ("tests/test_serve.py::test_the_openai_client_gets_what_hexq_run_gives",)),
    Mutant("stop-string-held-back-text-lost", "hexq/runtime/sampling.py",
           "        piece = full[len(self.text):] if full.startswith(self.text) else \"\"\n        self.text += piece\n"
           "        return piece\n\n\ndef",
           "        return \"\"\n\n\ndef", ("tests/test_sampling.py",)),
    Mutant("top-p-keeps-one-token-too-many", "hexq/runtime/sampling.py",
           "    keep = (torch.cumsum(sorted_probs, 0) - sorted_probs) < top_p",
           "    keep = (torch.cumsum(sorted_probs, 0) - 2 * sorted_probs) < top_p", ("tests/test_sampling.py",)),
    # ------------------------------------------------------------------ the kernels (C)
    Mutant("kernel-scale-from-the-wrong-group", "hexq/packed/kernels.c",
           "            const float wb = s[b / per_group] * dx[b];",
           "            const float wb = s[(b + 1) % blocks / per_group] * dx[b];", ("tests/test_packed_cpu.py",)),
    Mutant("avx2-unpack-shift-off-by-one", "hexq/packed/kernels.c",
           "            multiplier[8 * lane + j] = (int16_t)(1 << (7 - (bit & 7)));",
           "            multiplier[8 * lane + j] = (int16_t)(1 << (6 - (bit & 7) + ((bit & 7) == 7)));",
           ("tests/test_packed_cpu.py",)),
    Mutant("activation-block-scale-wrong", "hexq/packed/kernels.c",
           "static inline float block_step(float amax) { return amax / 32767.0f; }",
           "static inline float block_step(float amax) { return amax / 32000.0f; }", ("tests/test_packed_cpu.py",)),
    Mutant("dequant-zero-point-ignored", "hexq/packed/kernels.c",
           "            if (out_kind == 0) ((float*)out)[i] = (q - z) * s;",
           "            if (out_kind == 0) ((float*)out)[i] = q * s;", ("tests/test_packed_cpu.py",)),
    Mutant("planes-block-from-the-next-field", "hexq/packed/kernels.c",
           "        q = _mm256_or_si256(q, plane_bits(v, w, k % per, off));",
           "        q = _mm256_or_si256(q, plane_bits(v, w, (k + 1) % per, off));", ("tests/test_packed_cpu.py",)),
    Mutant("vnni-high-byte-weighed-128", "hexq/packed/kernels.c",
           "_mm256_dpbusd_epi32(_mm256_slli_epi32(high, 8), lo, q)",
           "_mm256_dpbusd_epi32(_mm256_slli_epi32(high, 7), lo, q)", ("tests/test_packed_cpu.py",), path="avx512"),
    Mutant("pool-run-skips-its-first-item", "hexq/packed/kernels.c",
           "        for (int64_t i = next; i < next + run; i++) j.run(j.ctx, i);",
           "        for (int64_t i = next + (run > 1); i < next + run; i++) j.run(j.ctx, i);",
           ("tests/test_packed_cpu.py",)),
    Mutant("planes-bytes-in-natural-order", "hexq/packed/kernels.c",
           "static inline int perm32(int j) { return (j >> 3 == 1 || j >> 3 == 2) ? j ^ 24 : j; }",
           "static inline int perm32(int j) { return j; }", ("tests/test_packed_cpu.py",)),
    Mutant("rows8-dword-from-the-next-field", "hexq/packed/kernels.c",
           "        q = _mm256_or_si256(q, plane_bits(v, w, d % per, off));",
           "        q = _mm256_or_si256(q, plane_bits(v, w, (d + 1) % per, off));",
           ("tests/test_packed_cpu.py",), path="avx512"),
    Mutant("activation-blocks-lanes-interleaved", "hexq/packed/kernels.c",
           "_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xd8)", "_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xe4)",
           ("tests/test_packed_cpu.py::test_activation_blocks_are_the_portable_ones_on_every_path",), path="avx2"),
    Mutant("silu-exp-polynomial-truncated", "hexq/packed/decode.c",
           "    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));\n",
           "", ("tests/test_native_decode.py",), path="avx2"),
    Mutant("attention-score-lanes-crossed", "hexq/packed/decode.c",
           "_mm256_permute2f128_ps(s0, s1, 0x31)", "_mm256_permute2f128_ps(s1, s0, 0x31)",
           ("tests/test_native_decode.py",), path="avx2"),
    Mutant("attention-one-head-in-one-chain", "hexq/packed/decode.c",
           "                odd[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * stride + u + 1), v1, odd[h]);",
           "                (heads == 1 ? even : odd)[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * stride + u + 1),"
           " v1, (heads == 1 ? even : odd)[h]);",
           ("tests/test_native_decode.py::test_attention_does_not_depend_on_the_thread_count",), path="avx2"),
    Mutant("rows8-zero-term-added", "hexq/packed/vnni256.h",
           "_mm256_fnmadd_ps(z, _mm256_set1_ps(zx[t][g]), acc[t])",
           "_mm256_fmadd_ps(z, _mm256_set1_ps(zx[t][g]), acc[t])", ("tests/test_packed_cpu.py",), path="avx512"),
    Mutant("rows8-transpose-keeps-the-low-halves", "hexq/packed/kernels.c",
           "        v[i + 4] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x31);",
           "        v[i + 4] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x20);", ("tests/test_packed_cpu.py",)),
    Mutant("rows8-scales-left-row-major", "hexq/packed/kernels.c",
           "            interleave8(grid, out, groups, j->path != PATH_SCALAR);",
           "            memcpy(out, grid, (size_t)(8 * groups) * 2);",
           ("tests/test_packed_cpu.py",)),
    Mutant("rows8-scales-transpose-groups-swapped", "hexq/packed/kernels.c",
           "_mm_storeu_si128((__m128i*)(out + (g + 2 * k + 1) * 8), _mm_unpackhi_epi64(b[k], b[k + 4]));",
           "_mm_storeu_si128((__m128i*)(out + (g + 2 * k + 1) * 8), _mm_unpacklo_epi64(b[k], b[k + 4]));",
           ("tests/test_packed_cpu.py",)),
    Mutant("rows8-avx512-lanes-in-natural-order", "hexq/packed/kernels.c",
           "        const int lane = perm32 ? (k & 4) | (k & 1) << 1 | (k & 2) >> 1 : k;",
           "        const int lane = k;", ("tests/test_packed_cpu.py",), path="avx512"),
    Mutant("rows8-avx512-transpose-keeps-the-low-halves", "hexq/packed/kernels.c",
           "        v[i + 4] = _mm512_permutex2var_epi64(first, high, second);",
           "        v[i + 4] = _mm512_permutex2var_epi64(first, low, second);", ("tests/test_packed_cpu.py",),
           path="avx512"),
    Mutant("rows8-bf16-table-codes-left-in-perm32-order", "hexq/packed/kernels.c",
           "                const __m512i q = _mm512_cvtepu8_epi16(_mm256_permute4x64_epi64(t[r], 0xd8));",
           "                const __m512i q = _mm512_cvtepu8_epi16(t[r]);", ("tests/test_packed_cpu.py",),
           path="avx512"),
    Mutant("dequant-item-reads-the-first-rows-scales", "hexq/packed/kernels.c",
           "    dequant_part(j->packed + r0 * row_bytes, j->bits, j->scale + r0 * groups, zero,",
           "    dequant_part(j->packed + r0 * row_bytes, j->bits, j->scale, zero,",
           ("tests/test_packed_cpu.py",)),
    Mutant("rows8-int8-blocks-scaled-by-int16-steps", "hexq/packed/vnni256.h",
           "_mm256_set1_ps(xq->dx8[t * blocks + b]), acc[t]);", "_mm256_set1_ps(xq->dx[t * blocks + b]), acc[t]);",
           ("tests/test_packed_cpu.py",), path="avx512"),
    Mutant("int8-zero-term-from-int16-sums", "hexq/packed/kernels.c",
           "out->zx8[k * blocks + b] = out->dx8[k * blocks + b] * (float)sum8;",
           "out->zx8[k * blocks + b] = out->dx8[k * blocks + b] * (float)sum;", ("tests/test_packed_cpu.py",)),
    Mutant("rows8-group-zero-term-from-its-last-block", "hexq/packed/vnni256.h",
           "b++) acc += xq->zx8[k * blocks + b];", "b++) acc = xq->zx8[k * blocks + b];", ("tests/test_packed_cpu.py",),
           path="avx512"),
    Mutant("rows8-avx2-maddubs-operands-swapped", "hexq/packed/kernels.c",
           "_mm256_maddubs_epi16(codes, x)", "_mm256_maddubs_epi16(x, codes)", ("tests/test_packed_cpu.py",),
           path="avx2"),
    Mutant("rows8-avx2-through-the-portable-loop", "hexq/packed/kernels.c",
           "(!(r0 % 8) && !(r1 % 8) ? rows8_maddubs : rows_scalar)(t, xq, r0, r1);", "rows_scalar(t, xq, r0, r1);",
           ("tests/test_packed_cpu.py",), path="avx2"),
    Mutant("int8-blocks-avx2-in-value-order", "hexq/packed/kernels.c",
           "_mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)", "_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)",
           ("tests/test_packed_cpu.py",), path="avx2"),
    Mutant("int8-blocks-portable-in-value-order", "hexq/packed/kernels.c",
           "nearbyintf(x[b * BLOCK + perm32(p)] * inv8)", "nearbyintf(x[b * BLOCK + p] * inv8)",
           ("tests/test_packed_cpu.py",)),
    Mutant("rows8z4-kernel-reads-float16-zeros", "hexq/packed/vnni256.h",
           "    if (t->layout == LAYOUT_ROWS8_Z4) {", "    if (0) {", ("tests/test_packed_cpu.py",), path="avx512"),
    Mutant("rows8z4-nibbles-of-a-byte-swapped", "hexq/packed/kernels.c",
           "(uint32_t)half_nibble(grid[r * groups + g]) << (4 * r);",
           "(uint32_t)half_nibble(grid[r * groups + g]) << (4 * (r ^ 1));", ("tests/test_packed_cpu.py",)),
    Mutant("rows8z4-avx2-nibbles-of-a-byte-swapped", "hexq/packed/kernels.c",
           "_mm256_slli_epi32(_mm256_cvttps_epi32(v), 4 * r)", "_mm256_slli_epi32(_mm256_cvttps_epi32(v), 4 * (r ^ 1))",
           ("tests/test_packed_cpu.py",), path="avx2"),
    Mutant("half-nibble-takes-zeros-up-to-31", "hexq/packed/kernels.c",
           "    if (k < 0 || k > 3 || (m & ((1 << (10 - k)) - 1))) return -1;",
           "    if (k < 0 || k > 4 || (m & ((1 << (10 - k)) - 1))) return -1;", ("tests/test_packed_cpu.py",)),
    Mutant("rows8z4-dequant-slices-zeros-as-float16", "hexq/packed/kernels.c",
           "    const uint16_t* zero = zero_rows(j->zero, j->layout, r0, groups);",
           "    const uint16_t* zero = j->zero + r0 * groups;", ("tests/test_packed_cpu.py",)),
    # ------------------------------------------------------------------ a prefill pass's memory
    Mutant("prefill-attention-repeats-heads", "hexq/model/attention.py",
           "    if attention_mask is None or not grouped", "    if True or attention_mask is None or not grouped",
           ("tests/test_prefill_memory.py",)),
    Mutant("routed-row-windows-start-at-each-experts-first-row", "hexq/runtime/compute.py",
           "                    window.append((weights, start + lo, hi - lo))",
           "                    window.append((weights, start, hi - lo))", ("tests/test_prefill_memory.py",)),
    # ------------------------------------------------------------------ the native decode step (C)
    Mutant("native-resume-runs-the-layer-again", "hexq/packed/decode.c",
           "        const int resuming = layer == r->layer;", "        const int resuming = 0;",
           ("tests/test_native_decode.py::test_native_step_under_a_small_fast_tier_loads_its_misses",)),
    Mutant("native-read-ahead-reads-nothing", "hexq/packed/decode.c",
           "if (range[2 * i + 1] > 0) posix_fadvise", "if (range[2 * i + 1] < 0) posix_fadvise",
           ("tests/test_native_decode.py::test_native_step_reads_its_misses_ahead",)),
    Mutant("native-resident-experts-not-adopted", "hexq/runtime/native.py",
           "        if self.loads:\n            self._adopt_resident()", "",
           ("tests/test_native_decode.py::test_native_step_under_a_small_fast_tier_loads_its_misses",)),
    Mutant("cache-experts-never-relaid", "hexq/runtime/experts.py",
           "if self.compute.lays_out(weights):  # cached or transient", "if False:  #",
           ("tests/test_runtime_packed.py::test_run_matches_eval_on_every_device",)),
    Mutant("transient-experts-in-another-layout", "hexq/runtime/experts.py",
           "weights = (self.compute.relaid(weights) if weights.transient", "weights = (weights if weights.transient",
           ("tests/test_runtime_packed.py::test_every_expert_reaches_the_kernels_in_their_layout",)),
    Mutant("self-check-in-the-stored-layout", "hexq/runtime/self_check.py",
           "                if runtime.compute.lays_out(probe):", "                if False:",
           ("tests/test_runtime_packed.py::test_every_expert_reaches_the_kernels_in_their_layout",)),
    Mutant("gguf-auto-refuses-where-a-wider-type-fits", "hexq/export/gguf/write.py", '        if experts == "auto":',
           "        if False:", ("tests/test_gguf.py::test_auto_writes_a_wider_type_where_a_source_is_missing",)),
    Mutant("cost-model-charges-the-call-to-one-expert", "hexq/runtime/cost.py",
           "slow = max(many - few, 0.0) / (3 * n_tokens)", "slow = many / (4 * n_tokens)",
           ("tests/test_cost_model.py::test_measure_latency_with_injected_clock",)),
    Mutant("slot-pools-keep-their-free-slots", "hexq/runtime/source.py",
           "                while slots and self.fast_tier.used", "                while False and self.fast_tier.used",
           ("tests/test_memory_plan.py::test_the_slot_pools_stay_within_the_one_count",)),
    Mutant("memory-plan-fast-tier-not-capped", "hexq/runtime/memory.py",
           "    fast_tier = min(fast_tier, expert_bytes) if cached else 0",
           "    fast_tier = fast_tier if cached else 0",
           ("tests/test_memory_plan.py::test_memory_is_split_once_and_the_fast_tier_gets_the_rest",)),
    Mutant("native-eviction-leaves-the-table-entry", "hexq/runtime/native.py",
           "            entry[0][key[1]] = _absent()", "            pass",
           ("tests/test_native_decode.py::test_native_step_under_a_small_fast_tier_loads_its_misses",)),
    Mutant("native-top-k-not-renormalised", "hexq/packed/decode.c",
           "    if (m->normalize)\n        for", "    if (0)\n        for", ("tests/test_native_decode.py",)),
    Mutant("native-rope-sign", "hexq/packed/decode.c",
           "        x[i + half] = b * cs[i] + a * sn[i];", "        x[i + half] = b * cs[i] - a * sn[i];",
           ("tests/test_native_decode.py",)),
    Mutant("native-skipped-weight-not-renormalised", "hexq/packed/decode.c",
           "        weights[n] = kept > 0.0f ? weights[j] * (all / kept) : 0.0f;", "        weights[n] = weights[j];",
           ("tests/test_native_decode.py",)),
    Mutant("smoothing-dense-error-on-every-rank", "hexq/calib/scales.py",
           "    dense = list(zip(weights, quantized, strict=True)) if ranks.leader else []",
           "    dense = list(zip(weights, quantized, strict=True))", ("tests/test_smoothing.py",)),
    Mutant("smoothing-ranks-errors-not-summed", "hexq/calib/scales.py",
           "    if not ranks.distributed:\n        return search\n", "    if True:\n        return search\n",
           ("tests/test_smoothing.py",)),
    Mutant("block-rounding-targets-from-the-quantized-stream", "hexq/calib/pipeline.py",
           "targets = model_outputs(loaded, reference, kwargs", "targets = model_outputs(loaded, hidden, kwargs",
           ("tests/test_low_bit_calibration.py",)),
    Mutant("block-rounding-stream-not-rebuilt-on-resume", "hexq/calib/pipeline.py",
           "            if reference is not None:  # before anything is folded into the layer",
           "            if reference is not None and index >= done:  # before anything is folded into the layer",
           ("tests/test_low_bit_calibration.py",)),
    Mutant("block-rounding-zero-off-the-integer-grid", "hexq/algos/rounding.py",
           "    return scale, grid.zero + shift + (shift.round() - shift).detach()",
           "    return scale, grid.zero + shift", ("tests/test_rounding.py",)),
    Mutant("block-rounding-zero-never-moves", "hexq/algos/rounding.py",
           "    return scale, grid.zero + shift + (shift.round() - shift).detach()",
           "    return scale, grid.zero + 0 * shift", ("tests/test_rounding.py",)),
    Mutant("triton-grid-rounds-half-away", "hexq/packed/triton.py",
           "        v = (v + 8388608.0) - 8388608.0", "        v = tl.floor(v + 0.5)",
           ("tests/test_packed_triton.py",)),
    Mutant("triton-grid-zero-not-rounded", "hexq/packed/triton.py",
           "                grid_zero = (tl.math.div_rn(-low, grid_scale) + 8388608.0) - 8388608.0",
           "                grid_zero = tl.math.div_rn(-low, grid_scale)", ("tests/test_packed_triton.py",)),
    Mutant("graph-rope-sign", "hexq/runtime/graph.py",
           "torch.cat([-x[..., half:], x[..., :half]], dim=-1)", "torch.cat([x[..., half:], -x[..., :half]], dim=-1)",
           ("tests/test_graph_decode.py",)),
    Mutant("graph-mask-hides-the-current-position", "hexq/runtime/graph.py",
           "seen = self.slots <= self.position", "seen = self.slots < self.position", ("tests/test_graph_decode.py",)),
    Mutant("graph-shared-expert-gate-ignored", "hexq/runtime/graph.py",
           "shared = torch.sigmoid(layer.shared_gate(h)) * shared", "shared = shared", ("tests/test_graph_decode.py",)),
    Mutant("graph-fused-input-off-the-w8a8-grid", "hexq/runtime/graph.py",
           "y = linear_from_codes(x, self.weight, self.quantizer, self.table, self.bits)",
           "y = linear_from_codes(x, self.weight, None, self.table, self.bits)", ("tests/test_graph_decode.py",)),
    Mutant("graph-host-read-of-the-token", "hexq/runtime/graph.py",
           "x = self.embed.index_select(0, self.token).float()", "x = self.embed[int(self.token)][None].float()",
           ("tests/test_graph_decode.py",)),
    Mutant("native-shared-expert-gate-ignored", "hexq/packed/decode.c",
           "1.0f / (1.0f + expf(-s->gate[0]))", "1.0f", ("tests/test_native_decode.py",)),
    Mutant("native-whole-qk-norm-dropped", "hexq/packed/decode.c",
           "    if (L->qk_norm == QK_WHOLE) {", "    if (0) {", ("tests/test_native_decode.py",)),
    Mutant("native-w8a8-grid-dropped", "hexq/packed/decode.c",
           "        if (m->act.bits) act_quant(&m->act, src, b->value, cols, codes);",
           "        if (0) act_quant(&m->act, src, b->value, cols, codes);", ("tests/test_native_decode.py",)),
    Mutant("native-w8a8-integer-zero-term-off-by-one", "hexq/packed/decode.c",
           "const double dot = qc + (128.0 - zx) * qsum", "const double dot = qc + (127.0 - zx) * qsum",
           ("tests/test_native_decode.py",), path="avx512"),
    Mutant("native-w8a8-256-code-sum-dropped", "hexq/packed/w8a8_256.h",
           "w8a8_row((double)qc, (double)qsum,", "w8a8_row((double)qc, 0.0,",
           ("tests/test_native_decode.py::test_w8a8_attention_on_every_kernel_path",), path="avxvnni"),
    Mutant("avx-vnni-copy-built-for-avx512", "hexq/packed/kernels.c",
           '#define VNNI256 __attribute__((target("avx2,fma,f16c,bmi2,avxvnni")))\n'
           '#define DPBUSD _mm256_dpbusd_avx_epi32',
           '#define VNNI256 __attribute__((target("avx2,fma,f16c,bmi2,avx512vnni,avx512vl")))\n'
           '#define DPBUSD _mm256_dpbusd_epi32',
           ("tests/test_packed_cpu.py::test_the_avx_vnni_copy_has_no_avx512_instruction",)),
    Mutant("native-kv-cache-position", "hexq/packed/decode.c",
           "        kv_store(m, kv_rows(m, m->k_cache, layer, h), pos, s->k + h * D);\n"
           "        kv_store(m, kv_rows(m, m->v_cache, layer, h), pos, s->v + h * D);",
           "        kv_store(m, kv_rows(m, m->k_cache, layer, h), pos ? pos - 1 : 0, s->k + h * D);\n"
           "        kv_store(m, kv_rows(m, m->v_cache, layer, h), pos ? pos - 1 : 0, s->v + h * D);",
           ("tests/test_native_decode.py",)),
    Mutant("prompt-reuse-drops-the-kept-positions", "hexq/runtime/prefix.py",
           "    if first:\n        cache[:, :, :first] = old[:, :, :first]\n", "", ("tests/test_prompt_reuse.py",)),
    Mutant("prompt-reuse-past-whole-passes", "hexq/runtime/prefix.py", "    return common - common % chunk",
           "    return common", ("tests/test_prompt_reuse.py::test_a_reused_prompt_gives_what_a_fresh_runtime_gives",)),
    Mutant("prompt-reuse-outlives-its-cache", "hexq/runtime/native.py",
           "        m, self.prompt = self.model, []  # the caller names the new prompt once its keys and values are in",
           "        m = self.model", ("tests/test_prompt_reuse.py",)),
    Mutant("prefill-passes-forget-the-earlier-ones", "hexq/runtime/engine.py",
           "            past = out.past_key_values\n", "            past = None\n",
           ("tests/test_runtime.py::test_prefill_in_passes_of_prefill_chunk",)),
    Mutant("down-fit-ridge-pulls-towards-w", "hexq/calib/down_fit.py",
           "    c_diagonal.add_(ridge[..., None] * gains)",
           "    c_diagonal.add_(ridge[..., None])", ("tests/test_down_fit.py",)),
    Mutant("down-fit-solve-always-in-float32", "hexq/calib/down_fit.py",
           "    return torch.float64 if hessian.dtype == torch.float64 or int(tokens.max()) > FLOAT32_TOKENS else "
           "torch.float32", "    return torch.float32", ("tests/test_down_fit.py",)),
    Mutant("inverse-hessian-factor-transposed-not-reversed", "hexq/algos/hessian.py",
           "    U = A.flip(-2, -1)", "    U = A.mT.contiguous()", ("tests/test_gptq_bank.py", "tests/test_gptq.py")),
    Mutant("loss-table-propagates-the-measured-sample", "hexq/calib/loss_table.py",
           "                    reuse = measure is x and quantizers == (None, None)",
           "                    reuse = quantizers == (None, None)", ("tests/test_calibrate.py",)),
    Mutant("down-fit-on-the-loss-tables-sample", "hexq/calib/down_fit.py",
           "        token, slot = routed.rows(experts[j])", "        token, slot = routed.sampled_rows(experts[j], 4)",
           ("tests/test_token_weights.py",)),
    Mutant("down-fit-gain-from-the-hessian", "hexq/calib/down_fit.py",
           "    aligned = ((weight @ cross.to(weight.dtype))", "    aligned = ((weight @ hessian.to(weight.dtype))",
           ("tests/test_down_fit.py",)),
    Mutant("down-fit-to-the-full-precision-intermediate", "hexq/calib/down_fit.py",
           "            got = replica_intermediates(x, replica_gate_ups[:, j], act_fn)",
           "            got = replica_intermediates(x, gate_up[j].expand_as(replica_gate_ups[:, j]), act_fn)",
           ("tests/test_down_fit.py",)),
    Mutant("bank-chunk-zero-points-read-as-scales", "hexq/calib/store.py",
           "PackedWeight(codes.reshape(-1), scale.flatten(0, 1), zero.flatten(0, 1)",
           "PackedWeight(codes.reshape(-1), scale.flatten(0, 1), scale.flatten(0, 1)",
           ("tests/test_pack.py::test_a_chunk_of_replicas_dequantizes_as_its_experts_one_by_one",)),
    Mutant("float16-kv-ties-away-from-zero", "hexq/packed/kernels.h",
           "    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;\n    return (uint16_t)(sign | half);\n}",
           "    if (rest >= 0x1000) half++;\n    return (uint16_t)(sign | half);\n}",
           ("tests/test_packed_cpu.py::test_the_float16_kv_cache_rounds_as_torch",)),
    Mutant("float16-kv-rows-read-at-float32-stride", "hexq/packed/decode.c",
           "_mm_loadu_si128((const __m128i*)(rows + i * 2))", "_mm_loadu_si128((const __m128i*)(rows + i * 4))",
           ("tests/test_native_decode.py",)),
    Mutant("native-reads-planes-as-the-stream", "hexq/runtime/native.py",
           "                      LAYOUTS.index(weight.layout))", "                      0)",
           ("tests/test_native_decode.py",)),
    # ------------------------------------------------------------------ the quantized head
    Mutant("head-served-with-the-w8a8-grid", "hexq/runtime/model.py",
           "        quantizer = None if weight_name == HEAD_WEIGHT else act_quantizer(",
           "        quantizer = act_quantizer(", ("tests/test_quantized_head.py",)),
    Mutant("head-rows-cut-with-the-wrong-scales", "hexq/packed/weight.py",
           "self.scale[start:stop],", "self.scale[start:stop].flip(0),", ("tests/test_quantized_head.py",)),
    Mutant("head-dequantized-whole-at-start-up", "hexq/model/streaming.py",
           "            if key in leave:", "            if False:", ("tests/test_quantized_head.py",)),
    Mutant("head-gptq-without-its-hessian", "hexq/calib/head.py",
           "expert_factor(hessian, setting, channel_max)", "expert_factor(torch.eye(cols)[None], setting, channel_max)",
           ("tests/test_quantized_head.py",)),
    # ------------------------------------------------------------------ work and memory that scale
    Mutant("allocation-loops-over-experts-squared", "hexq/algos/allocation.py",
           "        return _to_experts([0] * E, bits, ids)\n",
           "        return _to_experts([0] * E, bits, ids)\n    for _a in range(E):\n        for _b in range(E):\n"
           "            pass\n",
           ("tests/test_allocation.py::test_allocation_work_grows_no_faster_than_the_experts",)),
    Mutant("loss-table-output-reset-per-chunk", "hexq/calib/loss_table.py",
           "        fp_gate_up, fp_down = weights_of(experts)\n        rows =",
           "        out.zero_()\n        fp_gate_up, fp_down = weights_of(experts)\n        rows =",
           ("tests/test_calibrate.py::test_same_inputs_give_the_same_bytes",)),
    Mutant("checkpoint-maps-never-released", "hexq/model/checkpoint.py",
           "            if (row + 1) % max(1, MAPPED_BYTES // expert_bytes) == 0:",
           "            if False:",
           ("tests/test_streaming.py::test_experts_assembled_from_per_expert_tensors_hold_one_copy",)),
    Mutant("resident-skips-not-counted", "hexq/runtime/arena.py",
           "        self.skipped += ((bits == 0) & valid).sum()", "        pass",
           ("tests/test_runtime_packed.py::test_gpu_path_serves_skipped_experts_as_eval",)),
    # ------------------------------------------------------------------ pack's guard
    Mutant("pack-accepts-an-average-below-every-width", "hexq/pack/stage.py",
           "        if 0 in bits and avg < smallest and not budget.allow_skipping:",
           "        if False:", ("tests/test_cli.py",)),
    Mutant("pack-silent-about-missing-4-bit-replicas", "cli/main.py", "    if summary.without_4bit:",
           "    if False:", ("tests/test_pack.py",)),
    # ------------------------------------------------------------------ what the perplexity gate stands for
    # (the gate keys its cached calibrations on the code, so a mutant is calibrated afresh)
    Mutant("gate-experts-by-round-to-nearest", "hexq/calib/quantize.py",
           '    if setting.method == "rtn":  # per-row grids', '    if True:  # per-row grids', (), gate=True),
    Mutant("gate-allocation-ignores-the-loss-table", "hexq/algos/allocation.py",
           "    return allocate(loss, bits, order, costs=list(bits), budget=avg_bit_budget(avg_bits, loss.shape[0]))",
           "    return allocate(torch.zeros_like(loss), bits, order, costs=list(bits), "
           "budget=avg_bit_budget(avg_bits, loss.shape[0]))", (), gate=True),
    Mutant("gate-smoothing-off", "hexq/algos/smoothing.py",
           "    s = act_max.clamp(min=DEAD_CHANNEL_MAX).pow(exponent)",
           "    s = act_max.clamp(min=DEAD_CHANNEL_MAX).pow(0.0)", (), gate=True),
    Mutant("gate-activations-not-quantized", "hexq/model/simulate.py",
           "            return fake_quantize_activations(x, self.bits, per_token=True, symmetric=self.symmetric)",
           "            return x", (), gate=True),
    Mutant("gate-down-fit-off", "hexq/calib/quantize.py",
           'if projection == "down" and recipe.experts.down_fit == "replica":', "if False:", (), gate=True),
    Mutant("gate-two-bit-integer-zero-points", "hexq/algos/quant.py",
           "        return self.bits in self.float_zero_bits", "        return False", (), gate=True),
    Mutant("gate-spread-one-bit-levels-off", "hexq/algos/gptq.py",
           "                lo, hi = torch.where(grids.spread, low, lo), torch.where(grids.spread, high, hi)",
           "                lo, hi = lo, hi", (), gate=True),
]


def dirty(files: set[str]) -> list[str]:
    """Files among `files` with uncommitted changes (the run would otherwise restore them over your edits' base)."""
    status = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True)
    return [line[3:] for line in status.stdout.splitlines()]


def cpu_paths() -> list[str]:
    """The kernel paths this CPU runs (none without the kernels)."""
    from hexq.packed.cpu import available_paths, load_cpu_kernels

    kernels = load_cpu_kernels()
    return available_paths(kernels.library) if kernels else []


def run_mutant(mutant: Mutant) -> tuple[bool, str, float]:
    """(killed, by what, seconds): the mutant applied, its tests run, the source restored."""
    path = ROOT / mutant.file
    original = path.read_text()
    count = original.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: its source occurs {count} times in {mutant.file} (expected once); "
                         "update the mutant")
    started = time.perf_counter()
    command = [sys.executable, "scripts/ppl_gate.py"] if mutant.gate else [
        sys.executable, "-m", "pytest", "-q", "-x", "-rfEs", "-p", "no:cacheprovider", "-m", "not slow", *mutant.tests]
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    killed = done.returncode != 0
    if mutant.gate:  # "ppl gate FAILED in 7.9 min: mixtral uniform-4, ..."
        failed = re.findall(r"ppl gate FAILED in [\d.]+ min: (.*)$", done.stdout + done.stderr, re.M)
        by = f"the gate: {failed[0]}" if failed else (f"exit {done.returncode}" if killed else "-")
    else:
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
        skipped = re.findall(r"^SKIPPED \[\d+\] \S+ (.*)$", done.stdout, re.M)
        if failed:
            by = failed[0]
        elif killed:
            by = f"exit {done.returncode}"
        elif skipped and not re.search(r"\d+ passed", done.stdout):  # says why its tests did not run: still a survivor
            by = f"its tests skipped: {skipped[0]}"
        else:
            by = "-"
    return killed, by, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--gate", action="store_true", help="also the mutants the perplexity gate judges (slow)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (m.name in args.only if args.only else args.gate or not m.gate)]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name:45s} {m.file:28s} {'scripts/ppl_gate.py' if m.gate else ' '.join(m.tests)}")
        return 0
    stale = [m.name for m in chosen if (ROOT / m.file).read_text().count(m.old) != 1]
    if stale:  # before any mutant runs, not half an hour in (tests/test_mutants.py checks the same)
        print(f"error: the source of {', '.join(stale)} no longer occurs exactly once: update them", file=sys.stderr)
        return 2
    changed = dirty({m.file for m in chosen})
    if changed:
        print(f"error: uncommitted changes in {', '.join(changed)}: commit or stash them first", file=sys.stderr)
        return 2
    print("| mutant | file | killed by | seconds |\n|---|---|---|---|", flush=True)
    survivors, paths = [], cpu_paths()
    for mutant in chosen:
        if mutant.path and mutant.path not in paths:
            print(f"| {mutant.name} | {mutant.file} | not run: this CPU has no {mutant.path} path | 0 |", flush=True)
            continue
        killed, by, seconds = run_mutant(mutant)
        if not killed:
            survivors.append(mutant.name)
        verdict = by if killed else "SURVIVED" + (f" ({by})" if by != "-" else "")
        print(f"| {mutant.name} | {mutant.file} | {verdict} | {seconds:.0f} |", flush=True)
    ran = [m for m in chosen if not m.path or m.path in paths]
    print(f"\n{len(ran) - len(survivors)} of {len(ran)} mutants killed ({len(chosen) - len(ran)} not run on this CPU)"
          + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
