"""Calibration cost: hexq's 5-width replica bank (recipe experts-mixed: HAQ W8A8 attention, GPTQ replicas at 1, 2, 3, 4
and 8 bits + loss tables) against llmcompressor's single-width W4A16 GPTQ oneshot on the same model and the same
calibration windows, and against hexq's previous release (a source tree given with --previous), each in a fresh
subprocess, in one run: wall seconds, peak RSS and their ratios.

    python benchmarks/calibrate_cost.py --samples 64                        # the two reference models
    python benchmarks/calibrate_cost.py --models qwen3-30b-a3b --checkpoint qwen3-30b-a3b=/path/to/2-layer-ckpt \\
        --samples 128                                                       # a real-shaped checkpoint
    python benchmarks/calibrate_cost.py --models qwen3-1l --checkpoint qwen3-1l=/path/to/1-layer-ckpt --samples 32 \\
        --previous /path/to/an/older/tree --no-peer -o benchmarks/results/calibrate_bound.json  # against an older hexq

Real-shaped checkpoints come from scripts/make_checkpoint.py (published layer shapes, fewer layers). There the peer
loads the model in its stored bf16, as a user of that size would; on the reference models it runs in float32 like
hexq's quality comparisons. hexq's per-layer seconds (timings.json) are reported with an extrapolation to the
published model's depth.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
PUBLISHED_LAYERS = {"qwen3-30b-a3b": 48, "mixtral-8x7b": 32, "olmoe-1b-7b": 16}

# argv: checkpoint, windows, output folder, and for an older tree (on PYTHONPATH) its own experts-mixed.yaml: hexq's
# editable install maps hexq.recipes, and any module the older tree lacks, to this checkout, so the run checks that
# every hexq module it loaded came from the tree it measures.
HEXQ = """
import os, sys
from dataclasses import replace
from hexq.calib.pipeline import calibrate
try:  # its places in older trees first: a module a tree lacks would be found in this checkout
    from hexq.recipe_files import load_recipe
except ImportError:
    try:
        from hexq.recipe import load_recipe
    except ImportError:
        from hexq.config.recipe_files import load_recipe
recipe = load_recipe(sys.argv[4] if len(sys.argv) > 4 else "experts-mixed")
tree = os.environ.get("HEXQ_MEASURED_TREE")
strays = sorted(name for name, module in sys.modules.items() if name.split(".")[0] == "hexq" and tree
                and getattr(module, "__file__", None) and not module.__file__.startswith(tree))
if strays:
    raise SystemExit(f"modules from outside {tree}: {strays}")
recipe = replace(recipe, calibration=replace(recipe.calibration, num_samples=int(sys.argv[2])))
calibrate(sys.argv[1], recipe, "bundled", sys.argv[3])
"""

PEER = """
import sys, torch
from hexq.base.data import calibration_windows
from llmcompressor_peer import PEER_SCHEMES, run_peer
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = calibration_windows(tokenizer, "bundled", int(sys.argv[2]), 256, seed=0).ids
run_peer(sys.argv[1], PEER_SCHEMES["w4a16"], ids, dtype=getattr(torch, sys.argv[3]))
"""


def measure(code: str, *args: str, pythonpath: str | None = None, tree: bool = False) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `python -c code args`, with pythonpath first on sys.path (tree: it is an
    older hexq tree, which HEXQ checks its modules against). Called in a wrapper process whose only child is this run,
    so RUSAGE_CHILDREN's ru_maxrss (KiB on Linux) is that run's own peak."""
    import os

    env = os.environ | ({"PYTHONPATH": pythonpath} if pythonpath else {}) | (
        {"HEXQ_MEASURED_TREE": pythonpath} if tree else {})
    started = time.time()
    # run in the measured tree: `python -c` puts the working directory first on sys.path, so started from this
    # checkout an older tree's run would import this checkout's hexq (HEXQ's check names any such module)
    subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, env=env, cwd=pythonpath)
    wall = time.time() - started
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def in_wrapper(*args: str) -> tuple[float, int]:
    """One measured run in its own wrapper process (RUSAGE_CHILDREN's peak is a maximum over all children)."""
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return tuple(json.loads(out.stdout))


def git_commit(tree: Path) -> str | None:
    result = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="reference model names or names given "
                        "with --checkpoint")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=FOLDER",
                        help="a real-shaped checkpoint to measure under NAME (e.g. qwen3-30b-a3b=/data/q2)")
    parser.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens")
    parser.add_argument("--previous", type=Path, default=None,
                        help="source tree of hexq's previous release (its calibrate is timed on the same windows)")
    parser.add_argument("--no-peer", action="store_true", help="skip llmcompressor")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibrate_cost.json")
    args = parser.parse_args()
    record = start_run(args)
    folders = {name: str(path) for name, path in MODELS.items()}
    folders |= dict(item.split("=", 1) for item in args.checkpoint)
    previous = json.loads(args.out.read_text()).get("rows", []) if args.out.is_file() else []
    # rows of other models, or of these models at other window counts, stay
    rows = [row for row in previous if row.get("model") not in args.models or row.get("samples") != args.samples]
    for name in args.models:
        folder, real = folders[name], name not in MODELS
        row = {"model": name, "samples": args.samples, "seqlen": 256}
        with tempfile.TemporaryDirectory() as work:
            seconds, rss = in_wrapper("hexq", folder, str(args.samples), f"{work}/cal")
            timings = json.loads((Path(work) / "cal" / "timings.json").read_text())
            row |= {"hexq_bank_seconds": round(seconds, 1), "hexq_bank_peak_rss_mib": round(rss / 2**20),
                    "hexq_seconds_per_layer": [timings[key] for key in sorted(timings) if key.startswith("layer_")]}
            if name in PUBLISHED_LAYERS:
                per_layer = sum(row["hexq_seconds_per_layer"]) / len(row["hexq_seconds_per_layer"])
                row["hexq_extrapolated_hours"] = round(per_layer * PUBLISHED_LAYERS[name] / 3600, 2)
            if args.previous is not None:
                seconds, rss = in_wrapper("previous", str(args.previous), folder, str(args.samples), f"{work}/old",
                                          str(args.previous / "recipes" / "experts-mixed.yaml"))
                row |= {"previous_seconds": round(seconds, 1), "previous_peak_rss_mib": round(rss / 2**20),
                        "previous_commit": git_commit(args.previous),
                        "speedup_vs_previous": round(seconds / row["hexq_bank_seconds"], 2)}
        if not args.no_peer:
            seconds, rss = in_wrapper("peer", folder, str(args.samples), "bfloat16" if real else "float32")
            row |= {"llmc_w4a16_seconds": round(seconds, 1), "llmc_w4a16_peak_rss_mib": round(rss / 2**20),
                    "llmc_dtype": "bfloat16" if real else "float32",
                    "time_ratio": round(row["hexq_bank_seconds"] / seconds, 2),
                    "rss_ratio": round(row["hexq_bank_peak_rss_mib"] * 2**20 / rss, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(args.out, {"rows": rows}, record, merged=True)
    write_results(args.out, {"rows": rows}, record, complete=True, merged=True)


def child() -> None:
    kind, *rest = sys.argv[2:]
    if kind == "previous":
        tree, *rest = rest
        print(json.dumps(measure(HEXQ, *rest, pythonpath=tree, tree=True)))
    elif kind == "hexq":
        print(json.dumps(measure(HEXQ, *rest)))
    else:  # the peer's helper module lives in benchmarks/
        print(json.dumps(measure(PEER, *rest, pythonpath=str(ROOT / "benchmarks"))))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
