"""Quality at equal bytes for `hexq pack`: mixed (prefix-split) allocation vs uniform and importance-blind.

    python benchmarks/pack_quality.py                      # both reference models
    python benchmarks/pack_quality.py --models mixtral --windows 20

For each reference model: calibrate with recipe experts-mixed (bundled text, 128 windows of 256, seed 0; reused
when the folder already holds it), pack at 2.5 and 3.0 average bits, and evaluate on the same first N windows
(length 256) of WikiText-2 and the held-out austen / pydocs / foldoc text:
  fp            the source model
  uniform-b     every expert at b bits (the artifact's b-bit replicas)
  mixed-2.5/3.0 the artifact's allocation (importance order + loss table, prefix-structured)
  blind-2.5/3.0 the same bit histogram per layer randomly permuted across experts (mean of 3 seeds)
Attention is W8A8 (HAQ + GPTQ) in every quantized row, so rows differ only in the experts.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from hexq.artifact.reader import Artifact
from hexq.base.data import eval_text, tokenize
from hexq.calib.pipeline import calibrate
from hexq.config.recipe_files import load_recipe
from hexq.eval.perplexity import make_windows
from hexq.model.layer_pass import full_precision_plan, stream_nll
from hexq.model.streaming import open_model
from hexq.pack.stage import Budget, pack
from hexq.runtime.model import artifact_model

from provenance import start_run, write_results
from reference import shuffled_like

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
EVAL_DATA = ("wikitext2", "austen", "pydocs", "foldoc")
SEQLEN = 256
BLIND_SEEDS = (0, 1, 2)


def evaluate(target, windows: int) -> dict[str, float]:
    """Perplexity of (streamed model, tokenizer, prepare) on the first `windows` windows of every text."""
    streamed, tokenizer, prepare = target
    result = {}
    for source in EVAL_DATA:
        cut = make_windows(tokenize(tokenizer, eval_text(source)), SEQLEN, windows)
        result[source] = math.exp(float(stream_nll(streamed, cut, 8, prepare).sum()) / (cut.shape[0] * (SEQLEN - 1)))
    return result


def with_allocation(artifact: Artifact, allocation: list[list[int]]):
    """The artifact's model with every expert at allocation[layer][expert] (the artifact stores every width)."""
    return artifact_model(artifact, torch.device("cpu"), allocation=allocation)


def run_model(name: str, work: Path, windows: int, log) -> dict:
    calib = work / f"{name}-mixed"
    started = time.time()
    calibrate(MODELS[name], load_recipe("experts-mixed"), "bundled", calib, force=True)
    log(f"{name}: calibration ready ({time.time() - started:.0f}s)")
    artifacts = {}
    for avg in (2.5, 3.0):
        out = work / f"{name}-{avg}.hexq"
        pack(calib, out, budget=Budget(avg_bits=avg), overwrite=True, bank=("all",))
        artifacts[avg] = Artifact(out)
    reference = artifacts[2.5]
    layers, experts = len(reference.moe_layers), reference.num_experts
    rows: dict[str, dict] = {}
    streamed, tokenizer = open_model(MODELS[name], torch.device("cpu"))
    rows["fp"] = evaluate((streamed, tokenizer, full_precision_plan(streamed)), windows)
    log(f"{name} fp: {rows['fp']}")
    for bits in (2, 3, 4):
        rows[f"uniform-{bits}"] = evaluate(with_allocation(reference, [[bits] * experts] * layers), windows)
        log(f"{name} uniform-{bits}: {rows[f'uniform-{bits}']}")
    for avg, artifact in artifacts.items():
        rows[f"mixed-{avg}"] = evaluate(with_allocation(artifact, artifact.allocation), windows)
        log(f"{name} mixed-{avg}: {rows[f'mixed-{avg}']}")
        blind = [evaluate(with_allocation(artifact, [shuffled_like(row, seed * 1000 + layer)
                                                      for layer, row in enumerate(artifact.allocation)]), windows)
                 for seed in BLIND_SEEDS]
        rows[f"blind-{avg}"] = {source: sum(r[source] for r in blind) / len(blind) for source in EVAL_DATA}
        rows[f"blind-{avg}"]["seeds"] = {str(seed): r for seed, r in zip(BLIND_SEEDS, blind, strict=True)}
        log(f"{name} blind-{avg}: {rows[f'blind-{avg}']}")
    bytes_at = {row: sum(artifacts[2.5].manifest["accounting"]["expert_bytes_by_bits"][str(b)]
                         for layer in alloc for b in layer)
                for row, alloc in (("mixed-2.5", artifacts[2.5].allocation), ("mixed-3.0", artifacts[3.0].allocation))}
    return {"rows": rows, "expert_bytes": bytes_at,
            "allocation": {str(avg): a.allocation for avg, a in artifacts.items()}}


def render(results: dict) -> str:
    lines = []
    for name, result in results["models"].items():
        lines.append(f"\n{name} (window {SEQLEN}, first {results['windows']} windows per text)")
        lines.append("| allocation | " + " | ".join(EVAL_DATA) + " |")
        lines.append("|---" * (len(EVAL_DATA) + 1) + "|")
        for row, values in result["rows"].items():
            lines.append(f"| {row} | " + " | ".join(f"{values[s]:.3f}" for s in EVAL_DATA) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--windows", type=int, default=40, help="windows of 256 tokens per text")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "pack_quality.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    record = start_run(args)
    results = {"windows": args.windows, "seqlen": SEQLEN, "models": {}}
    for name in args.models:
        results["models"][name] = run_model(name, args.work, args.windows, lambda m: print(m, flush=True))
        write_results(args.out, results, record)
    write_results(args.out, results, record, complete=True)
    print(render(results))


if __name__ == "__main__":
    main()
