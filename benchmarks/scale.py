"""hexq at real size: every command on checkpoints with the exact layer shapes of a published MoE, time and peak RSS.

    python benchmarks/scale.py --work /data/hexq-scale                        # Qwen3-30B-A3B shapes, 2 and 8 layers
    python benchmarks/scale.py --work /data/hexq-scale --layers 20 --bank 2 3 4 --steps calibrate pack eval run

For each layer count: scripts/make_checkpoint.py writes the checkpoint (sharded bf16 + index, per-expert hub keys,
random weights with a skewed router), then `hexq calibrate` (recipe experts-mixed, or its bank cut to --bank),
`hexq pack --bits 3`, `hexq eval` of the checkpoint and of the artifact, `hexq export` and `hexq run --ppl` each run in
a fresh process whose wall time and peak RSS (the child's own ru_maxrss) are recorded, with the disk each output takes.
The question each row answers: does peak memory stay flat as layers are added (2 vs 8 layers within 10%), and does a
checkpoint bigger than this machine's memory go through every command?
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
HEXQ = [sys.executable, "-m", "hexq_cli.main"]
STEPS = ("checkpoint", "calibrate", "pack", "eval-model", "eval-artifact", "export", "run")


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def measured(command: list[str]) -> dict:
    """Wall seconds and peak RSS of one command, run from a wrapper process so ru_maxrss is that command's own."""
    out = subprocess.run([sys.executable, __file__, "--child", *command], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(command: list[str]) -> None:
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - started
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        sys.exit(result.returncode)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"seconds": round(wall, 1), "peak_rss_mib": round(peak / 2**20), "stdout": result.stdout[-2000:]}))


def recipe_file(work: Path, bank: list[int] | None) -> str:
    """experts-mixed, or experts-mixed with its replica bank cut to `bank` (to keep a large run's disk in bounds)."""
    if not bank:
        return "experts-mixed"
    import yaml

    from hexq.config.recipe_files import recipe_path

    recipe = yaml.safe_load(recipe_path("experts-mixed").read_text())
    recipe["experts"]["replica_bits"] = sorted(bank)
    recipe["experts"]["propagate_bits"] = max(b for b in bank if b <= 4)
    recipe["pack"] = {"bits": sorted(bank), "avg_bits": 3.0}
    path = work / f"experts-mixed-{'-'.join(map(str, sorted(bank)))}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="folder for checkpoints and outputs (tens of GB)")
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--samples", type=int, default=128, help="calibration windows of 256 tokens")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows of 256 tokens (held-out austen)")
    parser.add_argument("--bank", type=int, nargs="+", default=None, help="replica widths (default: 1 2 3 4 8)")
    parser.add_argument("--run-memory", default="8GiB", help="hexq run --memory")
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    parser.add_argument("--keep", action="store_true", help="keep checkpoints and outputs afterwards")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    args = parser.parse_args()
    record = start_run(args)
    args.work.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text())["rows"] if args.out.is_file() else []
    rows = [row for row in previous if row.get("family") != args.family or row.get("layers") not in args.layers]
    recipe = recipe_file(args.work, args.bank)
    for layers in args.layers:
        base = args.work / f"{args.family}-{layers}"
        checkpoint = base
        calibration, artifact, export = (base.with_name(base.name + suffix) for suffix in (".cal", ".hexq", ".ct"))
        commands = {
            "checkpoint": [sys.executable, "scripts/make_checkpoint.py", "--family", args.family, "--size",
                           "published", "--layers", str(layers), "--out", str(checkpoint), "--force"],
            "calibrate": [*HEXQ, "calibrate", str(checkpoint), "-r", recipe, "-n", str(args.samples), "-L", "256",
                          "-o", str(calibration), "--force", "--device", "cpu"],
            "pack": [*HEXQ, "pack", str(calibration), "--bits", "3", "-o", str(artifact), "--force"],
            "eval-model": [*HEXQ, "eval", str(checkpoint), "-d", "austen", "-n", str(args.windows), "--device", "cpu"],
            "eval-artifact": [*HEXQ, "eval", str(artifact), "-d", "austen", "-n", str(args.windows), "--device",
                              "cpu"],
            "export": [*HEXQ, "export", str(artifact), "-o", str(export), "--force", "-n", "2"],
            "run": [*HEXQ, "run", str(artifact), "--ppl", "austen", "-n", "2", "--memory", args.run_memory,
                    "--stats"],
        }
        outputs = {"checkpoint": checkpoint, "calibrate": calibration, "pack": artifact, "export": export}
        for step in args.steps:
            if step == "checkpoint" and checkpoint.is_dir():
                continue  # made by an earlier run: the same seed gives the same bytes
            result = measured(commands[step])
            row = {"family": args.family, "layers": layers, "step": step, "command": " ".join(commands[step][2:]),
                   **{k: v for k, v in result.items() if k != "stdout"}}
            if step in outputs:
                row["disk_mib"] = round(du(outputs[step]) / 2**20)
            if step == "calibrate" and (calibration / "timings.json").is_file():
                timings = json.loads((calibration / "timings.json").read_text())
                row["seconds_per_layer"] = [timings[key] for key in sorted(timings) if key.startswith("layer_")]
            if step.startswith("eval") and "stdout" in result:
                row["output"] = result["stdout"].strip().splitlines()[-3:]
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_results(args.out, {"rows": rows}, record, merged=True)
        if not args.keep:
            for path in (calibration, artifact, export):
                shutil.rmtree(path, ignore_errors=True)
    write_results(args.out, {"rows": rows}, record, complete=True, merged=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        os.environ.setdefault("PYTHONPATH", str(ROOT))
        main()
