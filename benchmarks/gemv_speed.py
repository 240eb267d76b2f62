"""The grouped GEMV alone: how fast hexq's CPU kernels read packed expert codes, against the machine's read bandwidth.

    python benchmarks/gemv_speed.py                       # every path this CPU runs, widths 2 3 4 8, 2 threads
    python benchmarks/gemv_speed.py --paths avx2 avx512 --bits 3 --threads 1 2
    python benchmarks/gemv_speed.py --layouts planes rows8   # both layouts on the VNNI paths, taking turns

What one decode step asks of the kernels for one MoE layer of Qwen3-30B-A3B's shape: the 8 routed experts of a token
(gate_up [1536, 2048] and down [2048, 768], asymmetric, groups of 32, float16 scale and zero, re-laid as the native step
serves them: rows8 on the AVX-512 and AVX-VNNI paths, planes on AVX2; --layouts forces layouts), one token, one call for
the 8 gate_up products and one for the 8 down products. A layer's experts are drawn from --layers distinct layers' worth
of random codes (a working set several times the last-level cache), cycled, so the codes come from memory as they do in
a real step.

Bytes per layer: codes + scales + zeros of the 16 matrices; GB/s = bytes / median seconds per layer (median over
--reps passes over the working set, the paths taking turns); share = GB/s over the read bandwidth (torch.sum over a
2 GiB float32 tensor on the same threads, median of 5: benchmarks/runtime.py read_bandwidth). Every path's outputs are
checked against the scalar path's on one layer (the same integer arithmetic, so the bound is float32 summation order).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from runtime import read_bandwidth

from hexq.packed.cpu import GemvJob, available_paths, load_cpu_kernels
from hexq.packed.weight import PackedWeight

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # Qwen3-30B-A3B: hidden 2048, moe_intermediate 768
TOP_K, GROUP = 8, 32


def random_weight(rows: int, cols: int, bits: int, generator: torch.Generator) -> PackedWeight:
    codes = torch.randint(0, 256, (rows * cols * bits // 8,), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, cols // GROUP, generator=generator) * 0.02 + 0.001).half()
    zero = torch.randint(0, 1 << bits, (rows, cols // GROUP), generator=generator).half()
    return PackedWeight(codes, scale, zero, bits, (rows, cols), "stream")


def weight_bytes(weight: PackedWeight) -> int:
    return weight.codes.numel() + 2 * weight.scale.numel() + 2 * weight.zero.numel()


def layer_jobs(layer: dict, x: torch.Tensor, mid: torch.Tensor, y_up: torch.Tensor, y_down: torch.Tensor):
    up = [GemvJob(w, x, y_up[e:e + 1]) for e, w in enumerate(layer["gate_up"])]
    down = [GemvJob(w, mid[e:e + 1], y_down[e:e + 1]) for e, w in enumerate(layer["down"])]
    return up, down


def measure(runs: dict, reps: int) -> dict[str, float]:
    """Median seconds per layer (gate_up call, then down call) per path of `runs` ({path: (kernels, layers)}), over
    `reps` passes over every layer; the paths take turns pass by pass, so a drift of the machine's speed during the
    run (seen here: ~10 <-> ~13 GB/s for minutes at a time) reaches every path alike."""
    hidden, inter = SHAPES["gate_up"][1], SHAPES["down"][1]
    x = torch.randn(1, hidden)
    mid = torch.randn(TOP_K, inter)
    y_up, y_down = torch.empty(TOP_K, 2 * inter), torch.empty(TOP_K, hidden)
    jobs = {path: [layer_jobs(layer, x, mid, y_up, y_down) for layer in layers]
            for path, (_, layers, _layout) in runs.items()}
    passes: dict[str, list[float]] = {path: [] for path in runs}
    for _ in range(reps + 1):  # the first pass warms the pool and the page tables
        for path, (kernels, layers, _layout) in runs.items():
            started = time.perf_counter()
            for up, down in jobs[path]:
                kernels.gemv(up)
                kernels.gemv(down)
            passes[path].append((time.perf_counter() - started) / len(layers))
    return {path: statistics.median(times[1:]) for path, times in passes.items()}


def check(kernels, reference, layer: dict) -> float:
    """Largest relative difference of one layer's outputs between `kernels` and the scalar path."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, SHAPES["gate_up"][1], generator=generator)
    mid = torch.randn(TOP_K, SHAPES["down"][1], generator=generator)
    outs = []
    for k in (kernels, reference):
        y_up, y_down = torch.empty(TOP_K, 2 * SHAPES["down"][1]), torch.empty(TOP_K, SHAPES["gate_up"][1])
        up, down = layer_jobs(layer, x, mid, y_up, y_down)
        k.gemv(up)
        k.gemv(down)
        outs.append(torch.cat([y_up.flatten(), y_down.flatten()]))
    return float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())


def render(results: dict) -> str:
    """The table under docs/runtime.md's marker (benchmarks/run_all.py)."""
    bandwidth = ", ".join(f"{gbps:.1f} GB/s on {threads}" for threads, gbps in results["bandwidth_gbps"].items())
    lines = [f"One MoE layer's 8 routed experts from memory (Qwen3-30B-A3B shapes, groups of 32); read bandwidth "
             f"{bandwidth} thread(s)", "| path | bits | layout | threads | ms per layer | GB/s | share of the read "
             "bandwidth | max rel. diff vs scalar |", "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['path']} | {r['bits']} | {r['layout']} | {r['threads']} | {r['ms_per_layer']:.3f} | "
                     f"{r['gbps']:.1f} | {r['share']:.0%} | {r['max_rel_diff_vs_scalar']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", default=None, help="kernel paths (default: every one this CPU runs "
                                                                 "but scalar)")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--layouts", nargs="+", default=None, choices=["planes", "rows8"],
                        help="re-lay the codes so on every path, each layout a run of its own (default: each path's "
                             "own, as hexq run re-lays them)")
    parser.add_argument("--layers", type=int, default=16, help="distinct layers of experts cycled (working set)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gemv_speed.json")
    args = parser.parse_args()
    run = start_run(args)
    base = load_cpu_kernels("scalar", 1)
    if base is None:
        raise SystemExit("error: the CPU kernels did not build")
    paths = args.paths or [p for p in available_paths(base.library) if p != "scalar"]
    results: dict = {"rows": []}
    for threads in args.threads:
        bandwidth = read_bandwidth(threads)
        results.setdefault("bandwidth_gbps", {})[str(threads)] = bandwidth
        print(f"{threads} thread(s): read bandwidth {bandwidth:.1f} GB/s")
        for bits in args.bits:
            generator = torch.Generator().manual_seed(bits)
            stream = [{name: [random_weight(*SHAPES[name], bits, generator) for _ in range(TOP_K)]
                       for name in SHAPES} for _ in range(args.layers)]
            layer_bytes = sum(weight_bytes(w) for name in SHAPES for w in stream[0][name])
            reference = base.with_path("scalar")
            runs = {}
            for path in paths:
                kernels = load_cpu_kernels(path, threads)
                for layout in args.layouts or [None]:
                    if layout == "rows8" and path not in ("avx512", "avxvnni"):
                        continue  # only the VNNI GEMVs read rows8 at speed (the others through the portable code)
                    copies = [{name: [kernels.relayout(replace(w, codes=w.codes.clone(), scale=w.scale.clone(),
                                                               zero=w.zero.clone()), layout) for w in layer[name]]
                               for name in SHAPES} for layer in stream]  # re-laid in place: a copy per run
                    made = copies[0]["gate_up"][0].layout  # 8-bit codes stay the stream whatever is asked
                    if all(run[0].path != path or run[2] != made for run in runs.values()):
                        runs[f"{path}/{layout}" if layout else path] = (kernels, copies, made)
            timed = measure(runs, args.reps)
            for name, (kernels, layers, layout) in runs.items():
                error, seconds = check(kernels, reference, layers[0]), timed[name]
                row = {"path": kernels.path, "bits": bits, "threads": threads, "ms_per_layer": seconds * 1e3,
                       "gbps": layer_bytes / seconds / 1e9, "share": layer_bytes / seconds / 1e9 / bandwidth,
                       "layer_mb": layer_bytes / 1e6, "layout": layout, "max_rel_diff_vs_scalar": error}
                results["rows"].append(row)
                print(f"  {kernels.path:7s} {bits}-bit ({row['layout']}): {row['ms_per_layer']:.3f} ms/layer, "
                      f"{row['gbps']:.1f} GB/s, {row['share']:.0%} of the read bandwidth "
                      f"(max rel diff vs scalar {error:.1e})")
            write_results(args.out, results, run)
            del runs
            del stream
    write_results(args.out, results, run, complete=True)


if __name__ == "__main__":
    main()
