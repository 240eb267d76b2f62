"""Calibration cost: hexq's full 5-width replica bank (experts-mixed recipe) vs llmcompressor's single W4A16
GPTQ oneshot, same model, same calibration windows, each in a fresh subprocess on this machine, one run.

    python benchmarks/calibrate_cost.py --samples 64

Prints wall time and peak RSS of each and their ratios (hexq / llmcompressor).
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

HEXQ = """
import sys
from dataclasses import replace
from hexq.calib.pipeline import calibrate
from hexq.recipe import load_recipe
recipe = load_recipe("experts-mixed")
recipe = replace(recipe, calibration=replace(recipe.calibration, num_samples=int(sys.argv[2])))
calibrate(sys.argv[1], recipe, "bundled", sys.argv[3])
"""

PEER = """
import sys
from hexq.data import calibration_windows
from hexq.eval.llmcompressor_peer import PEER_SCHEMES, run_peer
from hexq.models import load_model
_, tokenizer, _ = load_model(sys.argv[1])
ids = calibration_windows(tokenizer, "bundled", int(sys.argv[2]), 256, seed=0).ids
run_peer(sys.argv[1], PEER_SCHEMES["w4a16"], ids)
"""


def measure(code: str, *args: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `python -c code args`. Called in a wrapper process whose only child is
    this run, so RUSAGE_CHILDREN's ru_maxrss (KiB on Linux) is that run's own peak."""
    started = time.time()
    subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True)
    wall = time.time() - started
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibrate_cost.json")
    args = parser.parse_args()
    record = start_run(args)
    rows = []
    for name in args.models:
        folder = str(MODELS[name])
        with tempfile.TemporaryDirectory() as work:
            # RUSAGE_CHILDREN's peak is a running maximum over all children: each run gets its own wrapper
            hexq = json.loads(subprocess.run([sys.executable, __file__, "--child", "hexq", folder,
                                              str(args.samples), f"{work}/cal"], check=True,
                                             capture_output=True, text=True).stdout)
            peer = json.loads(subprocess.run([sys.executable, __file__, "--child", "peer", folder,
                                              str(args.samples)], check=True, capture_output=True, text=True).stdout)
        row = {"model": name, "samples": args.samples, "hexq_bank_seconds": round(hexq[0], 1),
               "hexq_bank_peak_rss_mib": round(hexq[1] / 2**20), "llmc_w4a16_seconds": round(peer[0], 1),
               "llmc_w4a16_peak_rss_mib": round(peer[1] / 2**20),
               "time_ratio": round(hexq[0] / peer[0], 2), "rss_ratio": round(hexq[1] / peer[1], 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(args.out, {"rows": rows}, record)
    write_results(args.out, {"rows": rows}, record, complete=True)


def child() -> None:
    kind, *rest = sys.argv[2:]
    print(json.dumps(measure(HEXQ if kind == "hexq" else PEER, *rest)))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
