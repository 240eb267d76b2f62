"""The benchmark suite: run every benchmark, write benchmarks/results/*.json, and regenerate README's tables.

    python benchmarks/run_all.py                 # everything (hours on 2 CPU cores; calibrate_table is the long one)
    python benchmarks/run_all.py --only runtime pack_quality
    python benchmarks/run_all.py --render-only   # rewrite README's tables from the JSON already there

README.md holds each table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; this script replaces what is
between the markers, together with the command and machine that produced it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from hexq.io import write_bytes_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# name: (script, JSON it writes); run in this order, each in its own process
BENCHMARKS = {
    "calibrate_table": ("calibrate_table.py", "calibrate.json"),
    "calibrate_cost": ("calibrate_cost.py", "calibrate_cost.json"),
    "placement": ("placement.py", "placement.json"),
    "pack_quality": ("pack_quality.py", "pack_quality.json"),
    "runtime": ("runtime.py", "runtime.json"),
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, no GPU" if not _has_cuda() else f"{cpu}, {os.cpu_count()} cores, CUDA"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load_script(name: str):
    script = ROOT / "benchmarks" / BENCHMARKS[name][0]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def render_placement(results: dict) -> str:
    lines = ["| model | K | scheme | mean hit rate | std across layers | max-min gap |", "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if row["trace"] == "heldout" and row["scheme"] in ("1", "2", "3"):
            lines.append(f"| {row['model']} | {row['K']} ({row['fraction']:.0%}) | {row['scheme']} | {row['mean']:.1%} "
                         f"| {row['std']:.1%} | {row['gap']:.1%} |")
    return "\n".join(lines)


def render_cost(results: dict) -> str:
    lines = ["| model | windows | hexq bank (1,2,3,4,8 bits) s | llmc W4A16 s | time ratio "
             "| peak RSS MiB hexq / llmc |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {r['samples']} | {r['hexq_bank_seconds']} | {r['llmc_w4a16_seconds']} | "
                     f"{r['time_ratio']} | {r['hexq_bank_peak_rss_mib']} / {r['llmc_w4a16_peak_rss_mib']} |")
    return "\n".join(lines)


def render(name: str, results: dict) -> str:
    if name == "placement":
        return render_placement(results)
    if name == "calibrate_cost":
        return render_cost(results)
    module = load_script(name)
    return (module.markdown if name == "calibrate_table" else module.render)(results).strip()


def update_readme(names: list[str], stamp: dict[str, str]) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name in names:
        path = RESULTS / BENCHMARKS[name][1]
        if not path.exists():
            continue
        body = render(name, json.loads(path.read_text()))
        command = f"python benchmarks/{BENCHMARKS[name][0]}"
        ran = stamp.get(name, f"results in benchmarks/results/{BENCHMARKS[name][1]}, measured on {machine()}")
        block = f"<!-- bench:{name} -->\n{body}\n\nReproduce: `{command}` ({ran}).\n"
        pattern = re.compile(rf"<!-- bench:{name} -->.*?(?=<!-- /bench:{name} -->)", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _m, b=block: b, text)
    write_bytes_atomic(readme, text.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    stamp = {}
    if not args.render_only:
        for name in args.only:
            started = time.time()
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / BENCHMARKS[name][0])], check=True, cwd=ROOT)
            stamp[name] = f"{time.strftime('%Y-%m-%d')}, {machine()}, {(time.time() - started) / 60:.0f} min"
    update_readme(args.only, stamp)
    print(f"README tables updated: {', '.join(args.only)}")


if __name__ == "__main__":
    main()
