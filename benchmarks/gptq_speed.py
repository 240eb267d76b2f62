"""GPTQ replica-bank speed: the per-expert, per-width column loop (benchmarks/gptq_reference.py) against the batched
`gptq_bank` (every expert of a chunk and every width in one column loop), on Qwen3-30B-A3B expert shapes.

    PYTHONPATH=. python benchmarks/gptq_speed.py --experts 8 --threads 1

Per expert: gate_up [2I, H] = [1536, 2048] with its input Hessian [2048, 2048] and down [H, I] = [2048, 768] with
[768, 768]; widths 1, 2, 3, 4, 8; groups of 32, asymmetric (the experts-mixed recipe). Hessians are 2 X^T X of
random correlated activations (a few thousand tokens through a mixing matrix with a decaying spectrum, plus a few
outlier channels), weights are random. The reference factorizes each Hessian once (float64) and runs one column
loop per width; the bank factorizes the chunk's Hessians together (float32) and runs one column loop in all.
Prints seconds per expert (wall and CPU) for each and their ratio, and how far the two results are apart (codes
that differ, relative loss difference). Writes benchmarks/results/gptq_speed.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import sys
import time
from pathlib import Path

import gptq_reference as reference
import torch

from hexq.algos.gptq import gptq_bank
from hexq.algos.hessian import factorize_hessians
from hexq.algos.quant import QuantSpec
from hexq.base.io import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, INTERMEDIATE = 2048, 768  # Qwen3-30B-A3B: hidden_size, moe_intermediate_size


def correlated_hessians(experts: int, n: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """[E, n, n] float32 Hessians 2 X^T X of X = Z M: channels mixed through M with a decaying spectrum (so H is far
    from diagonal and ill-conditioned, as real ones), a few outlier channels, each expert its own tokens."""
    mixing = torch.randn(n, n, generator=generator) / n**0.5
    mixing = mixing * torch.logspace(0, -2, n)[None, :] + 0.05 * torch.eye(n)
    hessians = torch.empty(experts, n, n)
    for e in range(experts):
        x = torch.randn(tokens, n, generator=generator) @ mixing.T
        x[:, :8] *= 10.0
        hessians[e] = 2 * x.T @ x
    return hessians


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8, help="experts in the gptq_bank chunk")
    parser.add_argument("--reference-experts", type=int, default=None,
                        help="experts run through the reference loop (default: all; it is the slow side)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens behind each Hessian")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gptq_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ref_experts = min(args.experts, args.reference_experts or args.experts)
    generator = torch.Generator().manual_seed(args.seed)
    spec = QuantSpec(bits=args.widths[0], group_size=args.group_size, symmetric=False)
    projections = {"gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}

    rows = []
    for name, (out_features, in_features) in projections.items():
        W = torch.randn(args.experts, out_features, in_features, generator=generator) * 0.02
        H = correlated_hessians(args.experts, in_features, args.tokens, generator)

        def run_bank(W=W, H=H):
            return gptq_bank(W, factorize_hessians(H), args.widths, spec, block_size=args.block_size)

        def run_reference(W=W, H=H):
            return [reference.gptq_replicas(W[e], H[e], args.widths, spec, block_size=args.block_size)
                    for e in range(ref_experts)]

        bank, bank_wall, bank_cpu = timed(run_bank)
        ref, ref_wall, ref_cpu = timed(run_reference)
        differ = total = 0
        loss_bank = loss_ref = 0.0
        for e, banks in enumerate(ref):
            for bits, want in banks.items():
                differ += int((bank[bits].codes[e] != want.codes).sum())
                total += want.codes.numel()
                loss_bank += float(bank[bits].loss[e].double().sum())
                loss_ref += float(want.loss.double().sum())
        row = {"projection": name, "weight": [out_features, in_features], "experts_bank": args.experts,
               "experts_reference": ref_experts,
               "reference_s_per_expert": round(ref_wall / ref_experts, 3),
               "bank_s_per_expert": round(bank_wall / args.experts, 3),
               "speedup": round((ref_wall / ref_experts) / (bank_wall / args.experts), 2),
               "reference_cpu_s_per_expert": round(ref_cpu / ref_experts, 3),
               "bank_cpu_s_per_expert": round(bank_cpu / args.experts, 3),
               "speedup_cpu": round((ref_cpu / ref_experts) / (bank_cpu / args.experts), 2),
               "codes_differing": differ / total, "loss_relative_difference": loss_bank / loss_ref - 1}
        rows.append(row)
        print(f"{name} {out_features}x{in_features}: reference {row['reference_s_per_expert']:.2f} s/expert, "
              f"bank {row['bank_s_per_expert']:.2f} s/expert, speedup {row['speedup']:.1f}x "
              f"(CPU time {row['speedup_cpu']:.1f}x); codes differing {row['codes_differing']:.1e}, "
              f"loss {row['loss_relative_difference']:+.1e}", flush=True)
    ref_total = sum(r["reference_s_per_expert"] for r in rows)
    bank_total = sum(r["bank_s_per_expert"] for r in rows)
    print(f"expert (gate_up + down, {len(args.widths)} widths): reference {ref_total:.2f} s, bank {bank_total:.2f} s, "
          f"speedup {ref_total / bank_total:.1f}x")
    write_json_atomic(args.out, {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "parameters": {**vars(args), "out": os.path.relpath(args.out, ROOT)},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "rows": rows,
        "expert_s": {"reference": round(ref_total, 3), "bank": round(bank_total, 3),
                     "speedup": round(ref_total / bank_total, 2)},
    })


if __name__ == "__main__":
    main()
