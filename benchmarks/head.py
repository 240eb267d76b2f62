"""What a quantized LM head (the recipe's `head` section, hexq.calib.head) buys and costs, measured in one run.

    python benchmarks/head.py --checkpoint CKPT            # speed and bytes at a real vocabulary
    python benchmarks/head.py --quality                    # KL divergence on the trained reference models
    python benchmarks/head.py --checkpoint CKPT --quality  # both

Speed (CKPT: `python scripts/make_checkpoint.py --family qwen3_moe --size published --layers 2 --out CKPT`, the
published vocabulary of 151,936): the checkpoint calibrated once per head setting (experts round-to-nearest at 3 bits
as in benchmarks/engines.py, on 4 windows: decode speed does not depend on how the codes were chosen; the head by
GPTQ), packed at 3 bits; per artifact the bytes one decode step reads (engines.bytes_per_token_hexq: the whole head is
read for every token), `hexq run`'s native decode tokens/s (engines' child: a 128-token prompt, --decode tokens, median
of --repeats processes) and peak RSS, and the calibration's seconds for the head and peak RSS (GNU time); with
--llama-cpp, llama.cpp's Q4_0 of the same checkpoint (llama-quantize keeps its head at Q6_K) by llama-bench, tg
--decode at depth 128.

Quality: each reference model calibrated with the bundled experts-mixed recipe on --windows windows once per head
setting, packed at 3 bits, and `hexq eval --kl-against` the model itself on --eval-windows held-out windows of 256
tokens of austen, pydocs and foldoc: mean KL divergence per token, top-1 agreement and perplexity.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from engines import (
    PROMPT_TOKENS,
    RTN_RECIPE,
    bytes_per_token_gguf,
    bytes_per_token_hexq,
    llama_ggufs,
    packed,
    prompt_ids,
    repeated,
)

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
HEADS = {"bf16 (as stored)": None, "8-bit per channel": {"bits": 8},
         "6-bit g32": {"bits": 6, "group_size": 32}, "4-bit g32": {"bits": 4, "group_size": 32}}
TEXTS = ("austen", "pydocs", "foldoc")
MODELS = {"qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe", "mixtral": ROOT / "models" / "hexq-tiny-mixtral"}


def hexq(*args: str, timed: Path | None = None) -> None:
    """One hexq command in a process of its own (under GNU time writing to `timed` when given)."""
    command = [sys.executable, "-m", "hexq_cli.main", *args]
    if timed is not None:
        command = ["/usr/bin/time", "-v", "-o", str(timed), *command]
    subprocess.run(command, check=True, cwd=ROOT)


def peak_rss_mib(timed: Path) -> float | None:
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", timed.read_text()) if timed.exists() else None
    return int(found.group(1)) / 1024 if found else None


def recipe_file(base: dict, head: dict | None, path: Path, **calibration) -> Path:
    """`base` with the head setting `head` (None: no head section, the head kept as stored)."""
    data = {key: value for key, value in base.items() if key != "head"} | ({"head": head} if head else {})
    if calibration:
        data["calibration"] = dict(data.get("calibration", {})) | calibration
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def calibrated(model: Path, recipe: Path, out: Path) -> dict:
    """The calibration and what it cost: the head's seconds and the process's peak RSS. hexq calibrate --force
    leaves a folder holding this very calibration as it is (the cost recorded by the run that made it is kept) and
    replaces one made from another recipe or checkpoint."""
    timed, trial = out.with_suffix(".time"), out.with_suffix(".time.new")
    manifest = out / "manifest.json"
    before = manifest.stat().st_mtime_ns if manifest.exists() else None
    hexq("calibrate", str(model), "-r", str(recipe), "-o", str(out), "--force", timed=trial)
    if before is None or manifest.stat().st_mtime_ns != before:
        trial.replace(timed)
    else:
        trial.unlink()
    timings = json.loads((out / "timings.json").read_text())
    return {"head_seconds": timings.get("head"), "calibration_peak_rss_mib": peak_rss_mib(timed)}


def speed(args: argparse.Namespace, results: dict, save) -> None:
    work = args.work / "speed"
    work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(RTN_RECIPE)
    rows = results.setdefault("speed", [])
    for name, head in HEADS.items():
        tag = name.split()[0]
        recipe = recipe_file(base, head, work / f"{tag}.yaml", num_samples=4)
        cost = calibrated(args.checkpoint, recipe, work / f"calibration-{tag}")
        artifact = packed(work / f"calibration-{tag}", recipe, work / f"hexq-3-{tag}.hexq", 3)
        traffic = bytes_per_token_hexq(artifact)
        spec = {"kind": "hexq", "artifact": str(artifact), "cache": "packed", "path": "native",
                "prompt": prompt_ids(artifact), "decode": args.decode, "threads": args.threads, "cold": False}
        row = repeated(spec, args.repeats)
        rows.append(row | cost | {"head": name, "bytes_per_token_mb": traffic["total"] / 1e6,
                                  "dense_mb": traffic["dense"] / 1e6})
        save()
    if args.llama_cpp is None:
        return
    config = json.loads((args.checkpoint / "config.json").read_text())
    gguf = llama_ggufs(args.checkpoint, args.llama_cpp, work)["llama.cpp Q4_0"]
    traffic = bytes_per_token_gguf(gguf, config["num_experts_per_tok"], config["num_experts"])
    spec = {"kind": "llama", "gguf": str(gguf), "llama_bin": str(args.llama_cpp / "build" / "bin"),
            "decode": args.decode, "threads": args.threads, "cold": False}
    row = repeated(spec, args.repeats)
    rows.append(row | {"head": "llama.cpp Q4_0 (its head Q6_K)", "bytes_per_token_mb": traffic["total"] / 1e6})
    save()


def quality(args: argparse.Namespace, results: dict, save) -> None:
    from hexq.config.recipe import recipe_to_dict
    from hexq.config.recipe_files import load_recipe

    work = args.work / "quality"
    work.mkdir(parents=True, exist_ok=True)
    base = recipe_to_dict(load_recipe("experts-mixed"))
    base.pop("head")
    rows = results.setdefault("quality", [])
    for model_name, model in MODELS.items():
        for name, head in HEADS.items():
            tag = f"{model_name}-{name.split()[0]}"
            recipe = recipe_file(base, head, work / f"{tag}.yaml", num_samples=args.windows)
            cost = calibrated(model, recipe, work / f"calibration-{tag}")
            artifact = packed(work / f"calibration-{tag}", recipe, work / f"{tag}-3.hexq", 3)
            report = work / f"{tag}-eval.json"
            texts = [arg for text in TEXTS for arg in ("-d", text)]
            hexq("eval", str(artifact), *texts, "-n", str(args.eval_windows), "--kl-against", str(model), "--json",
                 str(report))
            for entry in json.loads(report.read_text())["results"]:
                kl = entry["kl"]
                rows.append({"model": model_name, "head": name, "data": entry["data"], "kld_mean": kl["kld_mean"],
                             "kld_p99": kl["kld_p99"], "top1_agreement": kl["top1_agreement"],
                             "perplexity": entry["perplexity"], "reference_perplexity": kl["reference_perplexity"],
                             **cost})
            save()


def render(results: dict) -> str:
    lines = []
    if results.get("speed"):
        llama = next((r for r in results["speed"] if r["head"].startswith("llama.cpp") and "error" not in r), None)
        lines += [f"Real vocabulary (151,936 x 2048 head), {results['threads']} threads, {PROMPT_TOKENS}-token prompt; "
                  "hexq: 3-bit experts, native decode:", "",
                  "| hexq head / engine | bytes/token (MB) | decode tokens/s | / llama.cpp Q4_0 | peak RSS (MiB) | "
                  "head GPTQ (s) | calibration peak RSS (MiB) |", "|---|---|---|---|---|---|---|"]
        for row in results["speed"]:
            if "error" in row:
                lines.append(f"| {row['head']} | error: {row['error'][:100]} | | | | | |")
                continue
            seconds, calibration = row.get("head_seconds"), row.get("calibration_peak_rss_mib")
            ratio = f"{row['tokens_per_s'] / llama['tokens_per_s']:.2f}x" if llama else ""
            lines.append(f"| {row['head']} | {row['bytes_per_token_mb']:.0f} | {row['tokens_per_s']:.2f} | {ratio} | "
                         f"{row['peak_rss_mib']:.0f} | {'' if seconds is None else f'{seconds:.0f}'} | "
                         f"{'' if calibration is None else f'{calibration:.0f}'} |")
    if results.get("quality"):
        lines += ["", "Reference models, experts-mixed packed at 3 bits, KL divergence from the model itself:", "",
                  "| model | head | text | mean KLD | top-1 agreement | perplexity (full precision) |",
                  "|---|---|---|---|---|---|"]
        for row in results["quality"]:
            lines.append(f"| {row['model']} | {row['head']} | {row['data']} | {row['kld_mean']:.5f} | "
                         f"{row['top1_agreement']:.1%} | {row['perplexity']:.2f} ({row['reference_perplexity']:.2f}) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a real-vocabulary checkpoint (scripts/make_checkpoint.py)")
    parser.add_argument("--llama-cpp", type=Path, help="with --checkpoint: llama.cpp's source tree with its tools "
                        "built (benchmarks/engines.py): its Q4_0 of the checkpoint measured in the same run")
    parser.add_argument("--quality", action="store_true", help="the reference models' KL divergence per head")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "head")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=32, help="calibration windows (quality)")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows of 256 tokens per text")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "head.json")
    args = parser.parse_args()
    if args.checkpoint is None and not args.quality:
        parser.error("give --checkpoint, --quality or both")
    run = start_run(args)
    # the part not run now keeps its rows and the records of the runs that made them: speed and quality are measured
    # apart
    earlier = json.loads(args.out.read_text()) if args.out.is_file() else {}
    rerun = {"speed": args.checkpoint is not None, "quality": args.quality}
    kept = [key for key in ("speed", "quality") if key in earlier and not rerun[key]]
    results: dict = {key: earlier[key] for key in kept}

    def keep(record: dict) -> bool:
        made = {"speed": record["parameters"].get("checkpoint") is not None,
                "quality": bool(record["parameters"].get("quality"))}
        return any(made[key] for key in kept)

    results |= {"benchmark": "head", "threads": args.threads, "decode": args.decode}
    def save(complete: bool = False) -> None:
        write_results(args.out, results, run, complete=complete, merged=True, keep=keep)

    if args.checkpoint is not None:
        results["speed"] = []
        speed(args, results, save)
    if args.quality:
        results["quality"] = []
        quality(args, results, save)
    save(complete=True)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
