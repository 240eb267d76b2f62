"""The benchmark suite: run every benchmark, write benchmarks/results/*.json, and regenerate the tables of README.md and
docs/.

    python benchmarks/run_all.py                 # everything (hours on 2 CPU cores; calibrate_table is the long one)
    python benchmarks/run_all.py --only runtime pack_quality
    python benchmarks/run_all.py --render-only   # rewrite the tables from the JSON already there

README.md and docs/*.md hold each table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; this script replaces
what is between the markers. Under each table it writes what the results file says about the run that made it (the
"provenance" records of benchmarks/provenance.py: exact command, date, duration, machine); a file without them is
shown as "provenance not recorded", never with this machine's details.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from hexq.base.io import write_bytes_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# name: (script, JSON it writes); run in this order, each in its own process
BENCHMARKS = {
    "calibrate_table": ("calibrate_table.py", "calibrate.json"),
    "calibrate_cost": ("calibrate_cost.py", "calibrate_cost.json"),
    "calibrate_bound": ("calibrate_cost.py", "calibrate_bound.json"),
    "placement": ("placement.py", "placement.json"),
    "pack_quality": ("pack_quality.py", "pack_quality.json"),
    "low_bits": ("low_bits.py", "low_bits.json"),
    "low_bits_full": ("low_bits.py", "low_bits_full.json"),
    "low_bits_start": ("low_bits.py", "low_bits_start.json"),
    "low_bits_refit": ("low_bits.py", "low_bits_refit.json"),
    "low_bits_knobs": ("low_bits.py", "low_bits_knobs.json"),
    "low_bits_routed": ("low_bits.py", "low_bits_routed.json"),
    "low_bits_clip": ("low_bits.py", "low_bits_clip.json"),
    "low_bits_tokens": ("low_bits.py", "low_bits_tokens.json"),
    "low_bits_fit": ("low_bits.py", "low_bits_fit.json"),
    "runtime": ("runtime.py", "runtime.json"),
    "runtime_cgroup": ("runtime.py", "runtime_cgroup.json"),
    "gemv_speed": ("gemv_speed.py", "gemv_speed.json"),
    "gemv_speed_xeon": ("gemv_speed.py", "gemv_speed_xeon.json"),
    "engines": ("engines.py", "engines.json"),
    "engines_xeon": ("engines.py", "engines_xeon.json"),
    "serve": ("serve.py", "serve.json"),
    "prompt_reuse": ("prompt_reuse.py", "prompt_reuse.json"),
    "distributed": ("distributed.py", "distributed.json"),
    "distributed_haq": ("distributed.py", "distributed_haq.json"),
    "scale": ("scale.py", "scale.json"),
    "gguf_quality": ("gguf_quality.py", "gguf_quality.json"),
    "head": ("head.py", "head.json"),
    "gpu_check": ("../scripts/gpu_check.py", "gpu_check.json"),
}

# benchmarks that need arguments only the user can give (inputs of tens of GB, a GPU) or hours more than the rest;
# run_all renders their results but does not run them
RUN_BY_HAND = {"scale": "python benchmarks/scale.py --work DIR",
               "low_bits_full": "python benchmarks/low_bits.py --settings act+spread+float act+spread+float+down "
                                "--no-peers -o A.json, then --settings --peer-bits 2 3 -o B.json; B's peer rows merged "
                                "into A as "
                                "benchmarks/results/low_bits_full.json (--merge)",
               "low_bits_start": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings --peer-bits 3 2 "
                                 "--peers hexq hexq-rtn -o benchmarks/results/low_bits_start.json",
               "low_bits_refit": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings "
                                 "act+spread+float+down act+spread+float+down+refit --no-peers "
                                 "-o benchmarks/results/low_bits_refit.json",
               "low_bits_knobs": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings "
                                 "act+spread+float+down+refit12 act+spread+float+down+damp0.05 "
                                 "act+spread+float+down+damp0.1 --no-peers -o benchmarks/results/low_bits_knobs.json",
               "low_bits_routed": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings "
                                  "act+spread+float+down+routed --no-peers -o benchmarks/results/low_bits_routed.json, "
                                  "then --settings act+spread+float+down+routed+refit12 --merge -o the same file",
               "low_bits_clip": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings "
                                "act+spread+float+down+routed+clip --no-peers "
                                "-o benchmarks/results/low_bits_clip.json, then --settings "
                                "act+spread+float+down+routed --merge -o the same file",
               "calibrate_bound": "python benchmarks/calibrate_cost.py --models qwen3-1l --checkpoint "
                                  "qwen3-1l=CKPT --samples 32 --previous TREE --no-peer "
                                  "-o benchmarks/results/calibrate_bound.json, then --samples 128 (the same file)",
               "low_bits_tokens": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings "
                                  "act+spread+float+down+routed+clip --no-peers "
                                  "-o benchmarks/results/low_bits_tokens.json, then --settings "
                                  "act+spread+float+down+routed+clip+tok8k --merge -o the same file",
               "low_bits_fit": "python benchmarks/low_bits.py --models qwen3moe mixtral --settings "
                               "act+spread+float+down+routed+clip --no-peers -o benchmarks/results/low_bits_fit.json",
               "distributed": "python benchmarks/distributed.py --checkpoint CKPT",
               "distributed_haq": "python benchmarks/distributed.py --checkpoint CKPT --recipe haq-w8a8 "
                                  "--out benchmarks/results/distributed_haq.json",
               "engines": "python benchmarks/engines.py --checkpoint CKPT --llama-cpp DIR --cgroup",
               "engines_xeon": "python benchmarks/engines.py --checkpoint CKPT --llama-cpp DIR --cgroup "
                               "-o benchmarks/results/engines_xeon.json on an Intel Xeon",
               "gemv_speed_xeon": "python benchmarks/gemv_speed.py --layouts planes rows8 "
                                  "-o benchmarks/results/gemv_speed_xeon.json on an Intel Xeon",
               "gguf_quality": "python benchmarks/gguf_quality.py --work DIR --llama-cpp SRC",
               "prompt_reuse": "python benchmarks/prompt_reuse.py --artifact ART (a real-shaped artifact: "
                               "benchmarks/engines.py makes one)",
               "head": "python benchmarks/head.py --checkpoint CKPT --quality",
               "gpu_check": "bash scripts/gpu_check.sh on a machine with a GPU, its gpu_check.json copied to "
                            "benchmarks/results/",
               "runtime_cgroup": "python benchmarks/runtime.py --models --real ART --real-checkpoint CKPT "
                                 "--expert-fractions --cgroup -o benchmarks/results/runtime_cgroup.json"}


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
    lines = ["| model | windows | hexq bank (1,2,3,4,8 bits) s | s per layer | llmc W4A16 s | hexq / llmc time "
             "| peak RSS MiB hexq / llmc | previous hexq s (speed-up) | full model, extrapolated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        per_layer = r.get("hexq_seconds_per_layer") or []
        mean = f"{sum(per_layer) / len(per_layer):.1f}" if per_layer else "-"
        llmc = r.get("llmc_w4a16_seconds", "-")
        previous = (f"{r['previous_seconds']} ({r['speedup_vs_previous']}x)" if "previous_seconds" in r
                    else "-")
        # a checkpoint of no published model (older results wrote 0 h for it) has no depth to extrapolate to
        extrapolated = f"{r['hexq_extrapolated_hours']} h" if r.get("hexq_extrapolated_hours") else "-"
        lines.append(f"| {r['model']} | {r['samples']} | {r['hexq_bank_seconds']} | {mean} | {llmc} | "
                     f"{r.get('time_ratio', '-')} | {r['hexq_bank_peak_rss_mib']} / "
                     f"{r.get('llmc_w4a16_peak_rss_mib', '-')} | {previous} | {extrapolated} |")
    return "\n".join(lines)


def render_scale(results: dict) -> str:
    lines = ["| model | layers | step | seconds | s per layer | peak RSS MiB | disk MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        per_layer = r.get("seconds_per_layer")
        shown = f"{sum(per_layer) / len(per_layer):.0f}" if per_layer else "-"
        outcome = r.get("error")
        lines.append(f"| {r['family']} | {r['layers']} | {r['step']} | {r.get('seconds', '-')} | {shown} | "
                     f"{r.get('peak_rss_mib', '-') if not outcome else 'failed: ' + outcome} | "
                     f"{r.get('disk_mib', '-')} |")
    return "\n".join(lines)


def render(name: str, results: dict) -> str:
    if name == "placement":
        return render_placement(results)
    if name in ("calibrate_cost", "calibrate_bound"):
        return render_cost(results)
    if name == "scale":
        return render_scale(results)
    module = load_script(name)
    return (module.markdown if name == "calibrate_table" else module.render)(results).strip()


def describe_machine(machine: dict) -> str:
    memory = machine.get("memory_bytes")
    return (f"{machine.get('processor', 'processor unknown')}, {machine.get('cpu_count', '?')} CPUs "
            f"({machine.get('cpus_usable', '?')} usable), "
            f"{f'{memory / 2**30:.1f} GiB' if memory else 'memory unknown'}, {machine.get('cuda') or 'no GPU'}, "
            f"{machine.get('platform', 'platform unknown')}, torch {machine.get('torch', '?')} "
            f"({machine.get('torch_threads', '?')} threads)")


def describe_run(run: dict) -> str:
    seconds = run.get("seconds")
    if not isinstance(seconds, int | float):
        took = "duration unknown"
    else:
        took = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
    stopped = "" if run.get("complete") else ", stopped before the end"
    commit = run.get("git_commit")
    at = f" at {commit[:12]}{'+changes' if commit.endswith('+changes') else ''}" if commit else ""
    return (f"`{run.get('command', 'command unknown')}` (started {run.get('started', '?')}, {took}{stopped}; "
            f"{describe_machine(run.get('machine', {}))}; hexq {run.get('hexq_version', '?')}{at})")


def provenance_line(name: str, results: dict) -> str:
    """README's line under a table: the recorded runs of its results file, or that none were recorded."""
    script, file = BENCHMARKS[name]
    where = f"benchmarks/results/{file}"
    runs = results.get("provenance")
    if not isinstance(runs, list) or not runs or not all(isinstance(run, dict) for run in runs):
        machine = results.get("machine")
        also = f"; the file names its machine only as {machine!r}" if isinstance(machine, str) else ""
        return (f"Results in {where}, written by `benchmarks/{script}`; provenance not recorded (the exact command, "
                f"parameters, machine and date of the run are unknown{also}).")
    label = "Reproduce" if len(runs) == 1 else f"Reproduce ({len(runs)} runs)"
    return f"{label}: {'; '.join(describe_run(run) for run in runs)}. Results in {where}."


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the files whose tables are rendered here


def rendered_block(name: str) -> str | None:
    """What stands between a table's markers: the table rendered from its results file and the provenance line, or
    None when the file does not exist."""
    path = RESULTS / BENCHMARKS[name][1]
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    return f"{render(name, results)}\n\n{provenance_line(name, results)}\n"


def update_docs(names: list[str]) -> None:
    """Re-render the tables `names` wherever README.md and docs/*.md hold their markers."""
    for doc in DOCS:
        text = original = doc.read_text()
        for name in names:
            if f"<!-- bench:{name} -->" not in text:
                continue
            block = rendered_block(name)
            if block is None:
                continue
            pattern = re.compile(rf"<!-- bench:{name} -->\n.*?(?=<!-- /bench:{name} -->)", re.S)
            text = pattern.sub(lambda _m, b=block, n=name: f"<!-- bench:{n} -->\n{b}", text)
        if text != original:
            write_bytes_atomic(doc, text.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    if not args.render_only:
        for name in args.only:  # each script records its own command, machine and times in its results file
            if name in RUN_BY_HAND:
                print(f"{name}: not run here (by hand: {RUN_BY_HAND[name]}); its existing results are rendered")
                continue
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / BENCHMARKS[name][0])], check=True, cwd=ROOT)
    update_docs(args.only)
    print(f"tables updated in README.md and docs/: {', '.join(args.only)}")


if __name__ == "__main__":
    main()
