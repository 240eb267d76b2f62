"""Calibration split across ranks against one process, on a real-shaped layer: time, memory, and the scaling model.

    python scripts/make_checkpoint.py --family qwen3_moe --size published --layers 1 --vocab 8192 --out CKPT
    python benchmarks/distributed.py --checkpoint CKPT --samples 32

Runs, each a fresh `hexq calibrate` (--recipe, default experts-mixed; --samples windows x 256) into --work:
  one process   torch with every core (what a user runs on one machine)
  one thread    one process, OMP_NUM_THREADS=1 (what each rank computes with: the ranks' result is checked against
                this one bit for bit, since a BLAS with another thread count sums in another order)
  N ranks       torchrun --nproc_per_node N, OMP_NUM_THREADS=1 each (on this machine the ranks share its cores: no
                speed-up is expected, only no loss)
Wall time and peak RSS of each run (RUSAGE_CHILDREN: the largest process of the run), each process's own peak RSS
and seconds per stage (timings.json), and the scaling model fitted to them. Memory is reported whole and split: a
process first holds what every rank needs (the interpreter and torch, the layer's dense part, the hidden states, the
smoothing pass: its high-water mark when smoothing ends), then the routed experts' stages add their weights, Hessians
and GPTQ working set; that second part ("expert stages") is what ranks divide. The scaling model: the dense part
(smoothing, the quantized pass) is replicated on every rank; the routed experts' stages (Hessians and GPTQ in
"quantize", the loss table) divide by the world size; per layer the experts' two combined outputs (float64) are
summed by all_reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
# Published shapes for the projection: (MoE layers, routed experts, hidden, expert width)
MODELS = {"qwen3-30b-a3b": (48, 128, 2048, 768), "deepseek-v3": (58, 256, 7168, 2048),
          "kimi-k2": (60, 384, 7168, 2048)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# A wrapper per run, so that its RUSAGE_CHILDREN peak is that run's own (the largest of its processes).
WRAPPER = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
           "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
           "sys.exit(done.returncode)")


def run(command: list[str], env: dict) -> tuple[float, int]:
    """(seconds, peak RSS bytes of the largest process) of one command in a fresh child."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], env=os.environ | env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    peak = next(line for line in reversed(done.stderr.splitlines()) if line.startswith("peak_kib"))
    return seconds, int(peak.split()[1]) * 1024


def calibrate(checkpoint: Path, out: Path, samples: int, world: int, threads: int,
              recipe: str = "experts-mixed") -> dict:
    logs = out.with_name(out.name + "-torchrun")
    for folder in (out, logs):
        shutil.rmtree(folder, ignore_errors=True)
    hexq = ["-m", "hexq_cli.main", "calibrate", str(checkpoint), "-r", recipe, "--samples", str(samples),
            "-o", str(out)]
    if world == 1:
        command = [sys.executable, *hexq]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                   str(free_port()), "--log-dir", str(logs), *hexq]
    seconds, peak = run(command, {"OMP_NUM_THREADS": str(threads)})
    timings = json.loads((out / "timings.json").read_text())
    layers = sorted(key for key in timings if key.startswith("layer_"))
    stages = {layer: timings["stages"][layer] for layer in layers}
    return {"world": world, "threads": threads, "seconds": seconds, "peak_rss_bytes": peak,
            "layer_seconds": sum(timings[layer] for layer in layers) / len(layers), "stages": stages,
            "stage_peak_rss": timings.get("peak_rss_bytes"), "ranks": timings.get("ranks")}


def expert_stage_bytes(peak: int, stage_peaks: dict) -> int:
    """What the routed experts' stages add to a process: its peak beyond its high-water mark when smoothing ended
    (everything before is held by every rank alike)."""
    return peak - stage_peaks["smoothing"]


def memory_split(row: dict) -> list[tuple[int, int]]:
    """(peak RSS, expert-stage bytes) of each process of a run (one entry for one process, one per rank), first
    layer."""
    if row["ranks"]:
        ranks = next(iter(row["ranks"].values()))
        return [(r["peak_rss_bytes"], expert_stage_bytes(r["peak_rss_bytes"], r["stage_peak_rss"])) for r in ranks]
    peaks = next(iter(row["stage_peak_rss"].values()))
    peak = max(peaks.values())
    return [(peak, expert_stage_bytes(peak, peaks))]


def same_bits(a: Path, b: Path) -> bool:
    return all((b / path.name).read_bytes() == path.read_bytes() for path in sorted(a.glob("layer_*.safetensors")))


def projection(row: dict, world_sizes: tuple[int, ...], samples: int) -> list[dict]:
    """Per-layer wall time on `world` ranks of each MODELS entry, from this run's one-process stage seconds: the
    expert stages scale with experts x expert size (x routed tokens for their Hessians, at the same windows), the
    dense stages with hidden^2, and the experts' part divides by the world size. Communication: each rank receives
    (world - 1) x 2 x tokens x hidden x 8 bytes per layer."""
    stages = next(iter(row["stages"].values()))
    expert_seconds = stages.get("quantize", 0) + stages.get("loss table", 0)
    dense_seconds = stages.get("smoothing", 0) + stages.get("quantized pass", 0)
    base_experts, base_size, base_hidden = 128, 2048 * 768, 2048
    tokens = samples * 256
    out = []
    for name, (moe_layers, experts, hidden, width) in MODELS.items():
        expert_scale = experts * hidden * width / (base_experts * base_size)
        dense_scale = (hidden / base_hidden) ** 2
        for world in world_sizes:
            layer = dense_seconds * dense_scale + expert_seconds * expert_scale / world
            out.append({"model": name, "world": world, "seconds_per_layer": layer,
                        "hours": layer * moe_layers / 3600,
                        "received_mb_per_layer": 2 * (world - 1) / world * 2 * tokens * hidden * 8 / 1e6})
    return out


def render(results: dict) -> str:
    lines = [f"One real-shaped layer (Qwen3-30B-A3B shapes), {results['samples']} windows x 256, "
             f"{results.get('recipe', 'experts-mixed')}",
             "| run | wall s | s per layer | peak RSS MiB (largest process) | per process: peak RSS MiB, of it the "
             "expert stages MiB | per rank: quantize s, loss table s |", "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        ranks = ""
        for layer in (row["ranks"] or {}).values():
            ranks = "; ".join(f"{r['stages'].get('quantize', 0):.0f}, {r['stages'].get('loss table', 0):.0f}"
                              for r in layer)
        memory = "; ".join(f"{peak / 2**20:.0f}, {experts / 2**20:.0f}" for peak, experts in memory_split(row))
        name = f"{row['world']} ranks x 1 thread" if row["world"] > 1 else f"1 process x {row['threads']} threads"
        lines.append(f"| {name} | {row['seconds']:.0f} | {row['layer_seconds']:.0f} | "
                     f"{row['peak_rss_bytes'] / 2**20:.0f} | {memory} | {ranks or '-'} |")
    lines += [f"- ranks / one process (every core), wall time: {results['ratio']:.2f}",
              f"- largest rank / one process with one thread, peak RSS: {results['memory_ratio']:.2f}; the expert "
              f"stages' part of it: {results['expert_memory_ratio']:.2f}",
              f"- ranks bit for bit equal to one process with one thread: {results['same_bits']}"]
    if results.get("recipe", "experts-mixed") != "experts-mixed":  # `projection` counts smoothing as dense
        return "\n".join(lines + ["", "No projection for this recipe: its smoothing search scores every routed expert "
                                       "and is split across ranks, which the scaling model counts as dense."])
    lines += ["", "Projection (this CPU's per-stage seconds scaled by shape; GPU rates not measured):",
              "| model | ranks | s per MoE layer | hours (MoE layers) | MB received per rank per layer |",
              "|---|---|---|---|---|"]
    lines += [f"| {p['model']} | {p['world']} | {p['seconds_per_layer']:.0f} | {p['hours']:.1f} | "
              f"{p['received_mb_per_layer']:.0f} |" for p in results["projection"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--recipe", default="experts-mixed", help="bundled recipe name or YAML file")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "distributed")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distributed.json")
    args = parser.parse_args()
    run_record = start_run(args)
    args.work.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    rows = []
    for world, threads, name in ((1, cores, "one-process"), (1, 1, "one-thread"), (args.world, 1, "ranks")):
        row = calibrate(args.checkpoint, args.work / name, args.samples, world, threads, args.recipe)
        rows.append(row)
        print(f"{name}: {row['seconds']:.0f} s, peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    (single_peak, single_experts), ranks = memory_split(rows[1])[0], memory_split(rows[2])
    results = {"samples": args.samples, "recipe": args.recipe, "rows": rows,
               "ratio": rows[2]["seconds"] / rows[0]["seconds"],
               "memory_ratio": max(peak for peak, _ in ranks) / single_peak,
               "expert_memory_ratio": max(experts for _, experts in ranks) / single_experts,
               "same_bits": same_bits(args.work / "one-thread", args.work / "ranks"),
               "projection": projection(rows[0], (8, 64), args.samples)}
    write_results(args.out, results, run_record, complete=True)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
