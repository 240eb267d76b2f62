"""Speed of turning one packed expert into compute-ready weights (a cache miss of `hexq run`).

    python benchmarks/dequant_speed.py                        # 1 and 2 threads, widths 1 2 3 4 8
    python benchmarks/dequant_speed.py --threads 1 --reps 7 -o /tmp/dequant.json

The expert has Qwen3-30B-A3B's shapes: gate_up [1536, 2048] and down [2048, 768], RTN-quantized asymmetric with
groups of 32 and packed as hexq packs it (float16 scale and zero). Per width, each repetition produces the whole
expert (both matrices) and is timed; the table shows the median over repetitions as output bytes per second:
  old        the dequantization hexq had before bitpack.dequantize_into (unpack through int64 words,
             quant.dequantize in float32), then .to(bfloat16): what the runtime paid for a bf16 expert
  new bf16   dequantize_into a preallocated bfloat16 expert with a reused DequantScratch
  new fp32   the same into float32
  copy       out.copy_(src) of a bfloat16 tensor of the expert's size: the memory-bandwidth limit
new/copy is the ratio of output bytes per second. Every output is checked against the old path (bf16 and fp32
equal bit for bit). Also timed once per width: packing the expert, old and new pack_bits (3 bits only by default).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from hexq.algos.quant import QuantMeta, QuantSpec, dequantize, quantize
from hexq.base.io import write_json_atomic
from hexq.packed.bitpack import DequantScratch, dequantize_into, pack_bits

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # Qwen3-30B-A3B: hidden 2048, moe_intermediate 768
GROUP_SIZE = 32


# ------------------------------------------------------------------------------------------ the old path


def _group(bits: int) -> tuple[int, int]:
    span = math.lcm(bits, 8)
    return span // 8, span // bits


def old_pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """hexq's pack_bits before the word-view rewrite: one int64 per group of codes."""
    flat = codes.reshape(-1)
    numel = flat.numel()
    group_bytes, group_codes = _group(bits)
    flat = torch.nn.functional.pad(flat.to(torch.int64), (0, (-numel) % group_codes)).reshape(-1, group_codes)
    value = (flat << (bits * torch.arange(group_codes, dtype=torch.int64, device=flat.device))).sum(dim=1)
    byte_shifts = 8 * torch.arange(group_bytes, dtype=torch.int64, device=flat.device)
    stream = ((value[:, None] >> byte_shifts) & 0xFF).to(torch.uint8)
    return stream.reshape(-1)[: (bits * numel + 7) // 8].contiguous()


def old_unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """hexq's unpack_bits before the word-view rewrite (int64 temporaries for the 3-, 5-, 6- and 7-bit groups)."""
    group_bytes, group_codes = _group(bits)
    if group_bytes == 1:
        shifts = bits * torch.arange(group_codes, dtype=torch.uint8, device=packed.device)
        return ((packed[:, None] >> shifts) & (2**bits - 1)).reshape(-1)[:numel]
    grouped = torch.nn.functional.pad(packed, (0, (-packed.numel()) % group_bytes)).reshape(-1, group_bytes)
    byte_shifts = 8 * torch.arange(group_bytes, dtype=torch.int64, device=packed.device)
    value = (grouped.to(torch.int64) << byte_shifts).sum(dim=1)
    code_shifts = bits * torch.arange(group_codes, dtype=torch.int64, device=packed.device)
    return ((value[:, None] >> code_shifts) & (2**bits - 1)).to(torch.uint8).reshape(-1)[:numel]


def old_dequantize_bf16(packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                        shape: tuple[int, int]) -> torch.Tensor:
    """dequantize_packed(weight, float32) as it was, then .to(bfloat16)."""
    rows, cols = shape
    codes = old_unpack_bits(packed, bits, rows * cols).reshape(rows, cols)
    meta = QuantMeta(scale.float(), zero.float(), cols // scale.shape[-1], bits)
    return dequantize(codes, meta).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ measurement


def median_seconds(fn, reps: int) -> tuple[float, float]:
    """(median, min) wall time of fn() over `reps` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def packed_expert(bits: int, seed: int) -> dict[str, tuple]:
    """{projection: (codes, packed, scale, zero)} of a random expert quantized at `bits` as hexq packs it."""
    g = torch.Generator().manual_seed(seed)
    expert = {}
    for name, (rows, cols) in SHAPES.items():
        codes, meta = quantize(torch.randn(rows, cols, generator=g) * 0.02,
                               QuantSpec(bits, GROUP_SIZE, symmetric=False))
        expert[name] = (codes, pack_bits(codes, bits), meta.scale.half(), meta.zero.half())
    return expert


def measure_width(bits: int, reps: int, scratch: DequantScratch) -> dict:
    expert = packed_expert(bits, seed=bits)
    numel = sum(rows * cols for rows, cols in SHAPES.values())
    outs = {dtype: {name: torch.empty(shape, dtype=dtype) for name, shape in SHAPES.items()}
            for dtype in (torch.bfloat16, torch.float32)}
    sources = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in SHAPES.items()}

    def old() -> dict[str, torch.Tensor]:
        return {name: old_dequantize_bf16(packed, bits, scale, zero, SHAPES[name])
                for name, (_, packed, scale, zero) in expert.items()}

    def new(dtype: torch.dtype) -> None:
        for name, (_, packed, scale, zero) in expert.items():
            dequantize_into(outs[dtype][name], packed, bits, scale, zero, GROUP_SIZE, scratch)

    def copy() -> None:
        for name, src in sources.items():
            outs[torch.bfloat16][name].copy_(src)

    reference = old()
    new(torch.bfloat16)
    new(torch.float32)
    identical = all(torch.equal(outs[torch.bfloat16][n], reference[n]) and
                    torch.equal(outs[torch.float32][n].to(torch.bfloat16), reference[n]) for n in SHAPES)
    timings = {"old": (median_seconds(old, reps), 2),
               "new_bf16": (median_seconds(lambda: new(torch.bfloat16), reps), 2),
               "new_fp32": (median_seconds(lambda: new(torch.float32), reps), 4),
               "copy": (median_seconds(copy, reps), 2)}
    row = {"bits": bits, "identical_to_old": identical}
    for key, ((median, fastest), elem_bytes) in timings.items():
        row[key] = {"ms": median * 1e3, "min_ms": fastest * 1e3, "out_bytes": numel * elem_bytes,
                    "GBps": numel * elem_bytes / median / 1e9}
    for key in ("new_bf16", "new_fp32", "old"):
        row[f"{key}_over_copy"] = row[key]["GBps"] / row["copy"]["GBps"]
    return row


def measure_pack(bits: int, reps: int) -> dict:
    expert = packed_expert(bits, seed=100 + bits)
    codes = [c for c, _, _, _ in expert.values()]
    old_s, _ = median_seconds(lambda: [old_pack_bits(c, bits) for c in codes], reps)
    new_s, _ = median_seconds(lambda: [pack_bits(c, bits) for c in codes], reps)
    same = all(torch.equal(old_pack_bits(c, bits), pack_bits(c, bits)) for c in codes)
    return {"bits": bits, "old_ms": old_s * 1e3, "new_ms": new_s * 1e3, "identical": same}


def print_table(threads: int, rows: list[dict]) -> None:
    print(f"\n{threads} thread(s): median ms per expert (output GB/s); last columns: the same from the fastest rep")
    print(f"{'bits':>4} {'old->bf16':>17} {'new bf16':>17} {'new fp32':>17} {'copy bf16':>17} "
          f"{'bf16/copy':>9} {'fp32/copy':>9} {'new/old':>8} | {'min: bf16/copy':>14} {'fp32/copy':>9}")
    for r in rows:
        cells = [f"{r[k]['ms']:7.2f} ({r[k]['GBps']:5.1f})" for k in ("old", "new_bf16", "new_fp32", "copy")]
        best = {k: r["copy"]["min_ms"] / r[k]["min_ms"] * r[k]["out_bytes"] / r["copy"]["out_bytes"]
                for k in ("new_bf16", "new_fp32")}
        print(f"{r['bits']:>4} " + " ".join(f"{c:>17}" for c in cells) +
              f" {r['new_bf16_over_copy']:>9.1%} {r['new_fp32_over_copy']:>9.1%}"
              f" {r['old']['ms'] / r['new_bf16']['ms']:>7.1f}x | {best['new_bf16']:>14.1%} {best['new_fp32']:>9.1%}"
              + ("" if r["identical_to_old"] else "  MISMATCH"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--pack-bits", type=int, nargs="*", default=[3])
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "dequant_speed.json")
    args = parser.parse_args()

    scratch = DequantScratch.for_shapes(list(SHAPES.values()), "cpu")
    runs = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows = [measure_width(bits, args.reps, scratch) for bits in args.bits]
        print_table(threads, rows)
        runs[str(threads)] = rows
    torch.set_num_threads(args.threads[0])
    packing = [measure_pack(bits, max(3, args.reps // 3)) for bits in args.pack_bits]
    for p in packing:
        print(f"pack one expert at {p['bits']} bits: old {p['old_ms']:.1f} ms, new {p['new_ms']:.1f} ms"
              + ("" if p["identical"] else "  MISMATCH"))
    write_json_atomic(args.out, {
        "benchmark": "dequant_speed",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "load_average_at_end": os.getloadavg()},
        "parameters": {"shapes": SHAPES, "group_size": GROUP_SIZE, "symmetric": False, "scale_dtype": "float16",
                       "bits": args.bits, "threads": args.threads, "reps": args.reps,
                       "scratch_bytes": scratch.nbytes, "statistic": "median over reps (min_ms also recorded)"},
        "runs_by_threads": runs,
        "pack": packing,
    })
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
