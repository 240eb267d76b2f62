"""Where a decode step of `hexq run` spends its device time: the kernels of the CUDA graph step by time per token,
from torch's profiler (scripts/gpu_check.py runs it on each artifact it serves).

The step is profiled as it runs: graph replays, whose kernels the profiler sees where CUPTI records graph launches;
where it records none, the same step eagerly (the same kernels, each launched from Python), and the output says which.
On a machine without a GPU the CPU step is profiled instead, torch operators by CPU time (to check the script).

    python scripts/profile_decode.py ARTIFACT [--device cuda] [--tokens 16] [--top 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hexq.runtime.engine import Runtime
from hexq.runtime.graph import GraphDecoder

PROMPT = "It is a truth universally acknowledged"


def kernel_table(events, tokens: int, device: bool) -> tuple[list[dict], float, float]:
    """(rows by time per token, longest first; total ms per token; kernels or operators per token) of the profiler's
    key_averages: device kernels (device True) or CPU operators by self time."""
    rows = []
    for event in events:
        if device and event.device_type.name != "CUDA":
            continue
        seconds = (event.self_device_time_total if device else event.self_cpu_time_total) / 1e6
        if seconds > 0:
            rows.append({"name": event.key, "us_per_token": 1e6 * seconds / tokens, "per_token": event.count / tokens})
    rows.sort(key=lambda row: -row["us_per_token"])
    return rows, sum(row["us_per_token"] for row in rows) / 1e3, sum(row["per_token"] for row in rows)


def profile_steps(decoder, tokens: int, device: bool):
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])) as prof:
        for _ in range(tokens):
            decoder.step(1)
        if device:
            torch.cuda.synchronize()
    return prof.key_averages()


def profile_generate(runtime, tokens: int):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runtime.generate(PROMPT, tokens)
    return prof.key_averages()


def profile_decode(artifact: Path, device: str, tokens: int, top: int) -> dict:
    with Runtime(artifact, device=device) as runtime:
        runtime.generate(PROMPT, 4)  # kernels compiled, the graph captured, a sequence started
        decoder = runtime.native
        if not isinstance(decoder, GraphDecoder) or decoder.device.type != "cuda":
            rows, total, count = kernel_table(profile_generate(runtime, tokens), tokens, False)
            return {"path": runtime.decode_path, "profiled": "CPU operators of a whole generation (prefill too)",
                    "tokens": tokens, "ms_per_token": total, "launches_per_token": count, "top": rows[:top]}
        tokens = min(tokens, decoder.capacity - decoder.positions)  # the sequence's cache holds `capacity` positions
        rows, total, count = kernel_table(profile_steps(decoder, tokens, True), tokens, True)
        how = "graph replays" if decoder.captures else "eager steps"
        if count == 0:  # this CUPTI records no kernels inside graph replays: the same step eagerly
            decoder.captures = False
            rows, total, count = kernel_table(profile_steps(decoder, tokens, True), tokens, True)
            how = "eager steps (no kernels recorded inside graph replays)"
        return {"path": decoder.path, "profiled": how, "tokens": tokens, "ms_per_token": total,
                "launches_per_token": count, "top": rows[:top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps profiled (after 4 unprofiled ones)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = profile_decode(args.artifact, args.device, args.tokens, args.top)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
