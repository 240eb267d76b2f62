"""Runtime benchmark for `hexq run`: speed and quality under expert-memory budgets, one run per model.

    python benchmarks/runtime.py                         # both reference models
    python benchmarks/runtime.py --models mixtral --decode 32

Artifact: the reference model calibrated with experts-mixed and packed at 3.0 bits on average (made in --work if
missing, as benchmarks/pack_quality.py makes it). Budgets are 25%, 50% and 100% of the bytes of every expert
dequantized (the runtime's fast tier holds compute-ready float32 weights).

Configurations:
  resident    every expert loaded before timing (budget 100%, warm cache): the all-in-memory reference
  ondemand    no fast tier: every expert read, unpacked and dequantized from the artifact at each use
  lru         the cache without prefetch, static policy
  lru+pf      the cache with look-ahead prefetch, static policy
  context / online / depth   the precision policies, with prefetch
Workloads (each configuration in a fresh runtime):
  decode      a 128-token austen prompt, then 96 greedy tokens: TTFT, TPOT (median step), decode tokens/s,
              hit rate, bytes moved, wait time, prefetch precision / recall (over the whole generation)
  domain      perplexity on 8 windows of 256 tokens of held-out austen
  shift       8 windows of austen then 8 of pydocs in one runtime; perplexity on the pydocs part
online runs with K = 50% of each layer's experts at 4 bits and the rest at 2 (3.0 bits on average, the static
allocation's average); depth with lam 0.5 and 4/2 bits.
Adaptivity after the shift, at equal budget: a second artifact packed with widths {2, 4} only at 3.0 bits (the
calibration's most important half of each layer at 4 bits, the rest at 2) is run with `static` and with `online`
(same 4/2 split, hot set following the traffic) on the shift workload at the 50% budget.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from hexq.artifact.pack import pack
from hexq.calib.pipeline import calibrate
from hexq.data import eval_text, tokenize
from hexq.eval.perplexity import make_windows
from hexq.recipe import Pack, load_recipe
from hexq.runtime.engine import Runtime

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
SEQLEN, PROMPT_TOKENS = 256, 128
POLICY_OPTIONS = {"online": ({"high_bits": 4, "low_bits": 2}, 0.5), "depth": ({"high_bits": 4, "low_bits": 2}, None),
                  "context": ({}, None), "static": ({}, None)}


def artifact_for(name: str, work: Path, widths: tuple[int, ...] = (1, 2, 3, 4)) -> Path:
    out = work / (f"{name}-3.0.hexq" if widths == (1, 2, 3, 4) else f"{name}-3.0-w{''.join(map(str, widths))}.hexq")
    if not (out / "manifest.json").exists():
        calib = work / f"{name}-mixed"
        calibrate(MODELS[name], load_recipe("experts-mixed"), "bundled", calib)
        pack(calib, out, Pack(bits=widths, avg_bits=3.0), overwrite=True)
    return out


def open_runtime(artifact: Path, budget: int | None, config: str) -> Runtime:
    policy = config if config in POLICY_OPTIONS else "static"
    options, hot = POLICY_OPTIONS[policy]
    return Runtime(artifact, budget, policy, prefetch=config not in ("lru", "ondemand"),
                   mode="ondemand" if config == "ondemand" else "cache", policy_options=options, hot_fraction=hot)


def decode_run(runtime: Runtime, prompt: str, decode: int) -> dict:
    _, stats = runtime.generate(prompt, decode)
    result = stats.as_dict()
    cache = result["cache"]
    return {"ttft_ms": stats.ttft_seconds * 1000, "tpot_ms": stats.tpot_seconds * 1000,
            "decode_tokens_per_s": 1 / stats.tpot_seconds, "hit_rate": cache["hit_rate"],
            "bytes_moved_mib": cache["bytes_moved"] / 2**20, "wait_s": cache["wait_seconds"],
            "prefetch_precision": result["prefetch"]["precision"], "prefetch_recall": result["prefetch"]["recall"],
            "peak_mib": stats.peak_bytes / 2**20, "budget_mib": stats.budget_bytes / 2**20}


def nll_over(runtime: Runtime, windows: list[torch.Tensor]) -> float:
    return sum(float(runtime.window_nll(w)) for w in windows) / (len(windows) * (SEQLEN - 1))


def run_model(name: str, work: Path, decode: int, windows: int, log) -> dict:
    artifact = artifact_for(name, work)
    probe = Runtime(artifact)
    tokenizer, total = probe.tokenizer, probe.expert_bytes
    probe.close()
    austen, pydocs = (tokenize(tokenizer, eval_text(source)) for source in ("austen", "pydocs"))
    prompt = tokenizer.decode(austen[-PROMPT_TOKENS:])  # held-out text not used by the ppl windows below
    austen_windows = list(make_windows(austen, SEQLEN, windows))
    pydocs_windows = list(make_windows(pydocs, SEQLEN, windows))
    with Runtime(artifact) as warmup:  # one-time costs of the first forward passes stay out of every row
        warmup.generate(prompt, 8)
    rows = []
    plan = [("resident", 1.0), ("ondemand", 1.0)]
    plan += [(config, fraction) for fraction in (0.25, 0.5, 1.0)
             for config in ("lru", "lru+pf", "context", "online", "depth")]
    for config, fraction in plan:
        budget = int(total * fraction)
        row = {"config": config, "budget_fraction": fraction}
        with open_runtime(artifact, budget, config) as runtime:
            if config == "resident":
                runtime.warm()
            row |= decode_run(runtime, prompt, decode)
        with open_runtime(artifact, budget, config) as runtime:
            if config == "resident":
                runtime.warm()
            started = time.perf_counter()
            row["ppl_austen"] = math.exp(nll_over(runtime, austen_windows))
            row["ppl_tokens_per_s"] = len(austen_windows) * SEQLEN / (time.perf_counter() - started)
            row["ppl_pydocs_after_shift"] = math.exp(nll_over(runtime, pydocs_windows))
        rows.append(row)
        log(f"{name} {config} {fraction:.0%}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                                             if isinstance(v, float) and k != "budget_fraction"))
    split = artifact_for(name, work, (2, 4))
    for config in ("static", "online"):
        with open_runtime(split, int(total * 0.5), config if config == "online" else "lru+pf") as runtime:
            nll_over(runtime, austen_windows)
            shift = {"config": f"{config} (4/2 artifact)", "budget_fraction": 0.5,
                     "ppl_pydocs_after_shift": math.exp(nll_over(runtime, pydocs_windows))}
        rows.append(shift)
        log(f"{name} {shift}")
    return {"artifact": str(artifact), "expert_bytes": total, "rows": rows}


def ratios(result: dict) -> dict:
    """The issue's goals as ratios from this run."""
    by = {(r["config"], r["budget_fraction"]): r for r in result["rows"]}
    half, resident, ondemand = by[("lru+pf", 0.5)], by[("resident", 1.0)], by[("ondemand", 1.0)]
    static_shift = by[("static (4/2 artifact)", 0.5)]["ppl_pydocs_after_shift"]
    return {"lru+pf@50% / resident decode tok/s": half["decode_tokens_per_s"] / resident["decode_tokens_per_s"],
            "lru+pf@50% / ondemand decode tok/s": half["decode_tokens_per_s"] / ondemand["decode_tokens_per_s"],
            "prefetch recall lru+pf@50%": half["prefetch_recall"],
            "online / static pydocs ppl after the shift (4/2 artifact, 50%)":
                by[("online (4/2 artifact)", 0.5)]["ppl_pydocs_after_shift"] / static_shift}


COLUMNS = ("decode_tokens_per_s", "ttft_ms", "tpot_ms", "hit_rate", "bytes_moved_mib", "wait_s",
           "prefetch_recall", "ppl_austen", "ppl_pydocs_after_shift")


def render(results: dict) -> str:
    lines = []
    for name, result in results["models"].items():
        lines.append(f"\n{name}: expert bytes {result['expert_bytes'] / 2**20:.1f} MiB; decode {results['decode']} "
                     f"tokens after a {PROMPT_TOKENS}-token prompt (tokens/s = 1 / median step); ppl window "
                     f"{SEQLEN} x {results['windows']}; {results['threads']} torch thread(s)")
        lines.append("| config | budget | " + " | ".join(COLUMNS) + " |")
        lines.append("|---" * (len(COLUMNS) + 2) + "|")
        for row in result["rows"]:
            lines.append(f"| {row['config']} | {row['budget_fraction']:.0%} | "
                         + " | ".join(f"{row[c]:.3g}" if c in row else "" for c in COLUMNS) + " |")
        for key, value in result["ratios"].items():
            lines.append(f"- {key}: {value:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--decode", type=int, default=96)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the forward pass (1 leaves the "
                        "second core of a 2-core machine to the prefetch worker)")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "runtime.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = start_run(args)
    results = {"decode": args.decode, "windows": args.windows, "threads": torch.get_num_threads(), "models": {}}
    for name in args.models:
        result = run_model(name, args.work, args.decode, args.windows, lambda m: print(m, flush=True))
        result["ratios"] = ratios(result)
        results["models"][name] = result
        write_results(args.out, results, record)
    write_results(args.out, results, record, complete=True)
    print(render(results))


if __name__ == "__main__":
    main()
