"""The grouped GEMV alone: how fast hexq's CPU kernels read packed expert codes, against the machine's read bandwidth.

    python benchmarks/gemv_speed.py                       # every path this CPU runs, widths 2 3 4 8, 2 threads
    python benchmarks/gemv_speed.py --paths avx2 avx512 --bits 3 --threads 1 2
    python benchmarks/gemv_speed.py --layouts planes rows8 rows8z4   # each layout on the SIMD paths, taking turns

What one decode step asks of the kernels for one MoE layer of Qwen3-30B-A3B's shape: the 8 routed experts of a token
(gate_up [1536, 2048] and down [2048, 768], asymmetric, groups of 32, float16 scale and integer zero, re-laid as the
native step serves them: rows8z4 on the AVX-512, AVX-VNNI and AVX2 paths; --layouts forces layouts), one
token, one call for the 8 gate_up products and one for the 8 down products (each layer's C tasks made once, so that no
Python marshalling is timed: the native step has none). A layer's experts are drawn from --layers distinct layers' worth
of random codes (a working set several times the last-level cache), cycled, so the codes come from memory as they do in
a real step.

Bytes per layer: codes + scales + zeros of the 16 matrices as the kernels read them (PackedWeight.nbytes: rows8z4's
zeros in 4 bits); GB/s = bytes / median seconds per layer (median over --reps passes over the working set, the paths
taking turns); share = the median over the passes of the pass's GB/s over the read bandwidth measured in the same pass
(torch.sum over a 2 GiB float32 tensor on the same threads, timed after the paths in every pass: the machine's speed
drifts, and a bandwidth measured once before would compare the kernels with another minute's machine). Every path's
outputs are compared with the scalar path's on one layer: float32 summation order (~1e-6) where both read int16
activation blocks, the int8 blocks' rounding (~1e-2 of the largest output) for the SIMD paths' rows8 GEMVs (kernels.c
"int8 activation blocks").
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from runtime import bandwidth_tensor, read_pass

from hexq.packed.cpu import ROWS8_PATHS, GemvJob, available_paths, load_cpu_kernels
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


def layer_jobs(layer: dict, x: torch.Tensor, mid: torch.Tensor, y_up: torch.Tensor, y_down: torch.Tensor):
    up = [GemvJob(w, x, y_up[e:e + 1]) for e, w in enumerate(layer["gate_up"])]
    down = [GemvJob(w, mid[e:e + 1], y_down[e:e + 1]) for e, w in enumerate(layer["down"])]
    return up, down


def measure(runs: dict, reps: int, data: torch.Tensor) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per layer (gate_up call, then down call) per path of `runs` ({path: (kernels, layers)}) in each of
    `reps` passes over every layer, and the read bandwidth in GB/s measured in each pass (torch.sum over `data`, a
    benchmarks/runtime.py bandwidth_tensor, on torch's threads, after the paths). The paths and the bandwidth take
    turns pass by pass, so a drift of the machine's speed during the run (seen here: ~10 <-> ~13 GB/s for minutes at
    a time, and on some days the kernels' time changing 2x within a minute) reaches every path and the bandwidth it
    is compared with alike."""
    hidden, inter = SHAPES["gate_up"][1], SHAPES["down"][1]
    x = torch.randn(1, hidden)
    mid = torch.randn(TOP_K, inter)
    y_up, y_down = torch.empty(TOP_K, 2 * inter), torch.empty(TOP_K, hidden)
    # each layer's C tasks made once, as the native step holds its matrices: the timed loop is the kernels' calls
    jobs = {path: [tuple(kernels.tasks(calls) for calls in layer_jobs(layer, x, mid, y_up, y_down)) for layer in layers]
            for path, (kernels, layers, _layout) in runs.items()}
    passes: dict[str, list[float]] = {path: [] for path in runs}
    bandwidth: list[float] = []
    for _ in range(reps + 1):  # the first pass warms the pool, the page tables and the tensor
        for path, (kernels, layers, _layout) in runs.items():
            started = time.perf_counter()
            for up, down in jobs[path]:
                kernels.run_tasks(up)
                kernels.run_tasks(down)
            passes[path].append((time.perf_counter() - started) / len(layers))
        bandwidth.append(read_pass(data))
    return {path: times[1:] for path, times in passes.items()}, bandwidth[1:]


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
    per_pass = all("read_gbps" in r for r in results["rows"])  # results from before the bandwidth was per pass: not
    how = "(median of every pass) " if per_pass else ""
    share = "; share: per pass, against that pass's bandwidth" if per_pass else ""
    lines = [f"One MoE layer's 8 routed experts from memory (Qwen3-30B-A3B shapes, groups of 32); read bandwidth "
             f"{how}{bandwidth} thread(s){share}",
             "| path | bits | layout | threads | ms per layer | GB/s | share of the read "
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
    parser.add_argument("--layouts", nargs="+", default=None, choices=["planes", "rows8", "rows8z4"],
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
    data = bandwidth_tensor()  # read in every pass (measure)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for bits in args.bits:
            generator = torch.Generator().manual_seed(bits)
            stream = [{name: [random_weight(*SHAPES[name], bits, generator) for _ in range(TOP_K)]
                       for name in SHAPES} for _ in range(args.layers)]
            reference = base.with_path("scalar")
            runs = {}
            for path in paths:
                kernels = load_cpu_kernels(path, threads)
                for layout in args.layouts or [None]:
                    if layout in ("rows8", "rows8z4") and path not in ROWS8_PATHS:
                        continue  # the portable path reads rows8 too, slowly
                    copies = [{name: [kernels.relayout(replace(w, codes=w.codes.clone(), scale=w.scale.clone(),
                                                               zero=w.zero.clone()), layout) for w in layer[name]]
                               for name in SHAPES} for layer in stream]  # re-laid in place: a copy per run
                    made = copies[0]["gate_up"][0].layout  # 8-bit codes stay the stream whatever is asked
                    if all(run[0].path != path or run[2] != made for run in runs.values()):
                        runs[f"{path}/{layout}" if layout else path] = (kernels, copies, made)
            timed, bandwidth = measure(runs, args.reps, data)
            results.setdefault("bandwidth_gbps", {}).setdefault(str(threads), []).extend(bandwidth)
            print(f"{threads} thread(s), {bits}-bit: read bandwidth {statistics.median(bandwidth):.1f} GB/s "
                  f"(passes {min(bandwidth):.1f}-{max(bandwidth):.1f})")
            for name, (kernels, layers, layout) in runs.items():
                error, seconds = check(kernels, reference, layers[0]), statistics.median(timed[name])
                layer_bytes = sum(w.nbytes for name in SHAPES for w in layers[0][name])  # as read: rows8z4's zeros
                # each pass's GB/s over the bandwidth measured in that pass: the share a drift does not move
                per_pass = zip(timed[name], bandwidth, strict=True)
                share = statistics.median(layer_bytes / s / 1e9 / gbps for s, gbps in per_pass)
                row = {"path": kernels.path, "bits": bits, "threads": threads, "ms_per_layer": seconds * 1e3,
                       "gbps": layer_bytes / seconds / 1e9, "share": share, "read_gbps": statistics.median(bandwidth),
                       "layer_mb": layer_bytes / 1e6, "layout": layout, "max_rel_diff_vs_scalar": error}
                results["rows"].append(row)
                print(f"  {kernels.path:7s} {bits}-bit ({row['layout']}): {row['ms_per_layer']:.3f} ms/layer, "
                      f"{row['gbps']:.1f} GB/s, {row['share']:.0%} of the read bandwidth "
                      f"(max rel diff vs scalar {error:.1e})")
            write_results(args.out, results, run)
            del runs
            del stream
    results["bandwidth_gbps"] = {t: statistics.median(v) for t, v in results["bandwidth_gbps"].items()}
    write_results(args.out, results, run, complete=True)


if __name__ == "__main__":
    main()
