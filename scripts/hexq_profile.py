"""Where hexq spends its time on a device, from torch's profiler: `hexq run`'s decode step (its kernels by device time
per token) or one `hexq calibrate` (device time against wall time, the kernels and host operators that take it, and
the host's waits for the device). scripts/gpu_check.py runs both; on a machine without a GPU they profile the CPU's
torch operators instead (to check the script).

    python scripts/hexq_profile.py decode ARTIFACT [--tokens 16] [--top 8] [--device cuda] [--json OUT]
    python scripts/hexq_profile.py calibrate MODEL [--samples 128] [--top 10] [--device cuda] [--json OUT]

decode profiles the step as it runs: graph replays, whose kernels the profiler sees where CUPTI records graph
launches; where it records none, the same step eagerly (the same kernels, each launched from Python), and says which.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PROMPT = "It is a truth universally acknowledged"
# operators that make the host wait for the device (a value read back, a blocking copy, an explicit wait)
SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
         "cudaEventSynchronize")


def ranked(events, device: bool, per: int = 1) -> list[dict]:
    """Profiler averages longest first: {name, seconds, count} per `per` (tokens, say), timed by their self time on
    the device (device True: kernels) or on the host (operators); events that took no time are left out."""
    rows = []
    for event in events:
        seconds = (event.self_device_time_total if device else event.self_cpu_time_total) / 1e6
        if seconds > 0:
            rows.append({"name": event.key[:100], "seconds": seconds / per, "count": event.count / per})
    return sorted(rows, key=lambda row: -row["seconds"])


def kernels_of(events) -> list:
    return [event for event in events if event.device_type.name == "CUDA"]


def host_of(events) -> list:
    return [event for event in events if event.device_type.name == "CPU"]


def activities(device: bool) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])


def profile_decode(artifact: Path, device: str, tokens: int, top: int) -> dict:
    from hexq.runtime.engine import Runtime
    from hexq.runtime.graph import GraphDecoder

    with Runtime(artifact, device=device) as runtime:
        runtime.generate(PROMPT, 4)  # kernels compiled, the graph captured, a sequence started
        decoder = runtime.native
        if not isinstance(decoder, GraphDecoder) or decoder.device.type != "cuda":
            with profile(activities=activities(False)) as prof:
                runtime.generate(PROMPT, tokens)
            rows, how = ranked(prof.key_averages(), False, tokens), "CPU operators of a whole generation (prefill too)"
        else:
            tokens = min(tokens, decoder.capacity - decoder.positions)  # the sequence's cache holds `capacity`
            rows, how = decode_kernels(decoder, tokens), "graph replays" if decoder.captures else "eager steps"
            if not rows:  # this CUPTI records no kernels inside graph replays: the same step eagerly
                decoder.captures = False
                rows, how = decode_kernels(decoder, tokens), "eager steps (no kernels recorded inside graph replays)"
        return {"path": runtime.decode_path, "profiled": how, "tokens": tokens,
                "ms_per_token": 1e3 * sum(row["seconds"] for row in rows),
                "launches_per_token": sum(row["count"] for row in rows), "top": rows[:top]}


def decode_kernels(decoder, tokens: int) -> list[dict]:
    with profile(activities=activities(True)) as prof:
        for _ in range(tokens):
            decoder.step(1)
        torch.cuda.synchronize()
    return ranked(kernels_of(prof.key_averages()), True, tokens)


def profile_calibration(model: Path, samples: int, device: str, top: int) -> dict:
    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe_files import load_recipe

    recipe = load_recipe("experts-mixed")
    recipe = replace(recipe, calibration=replace(recipe.calibration, num_samples=samples))
    on_device = device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="hexq-profile-") as work:
        started = time.perf_counter()
        with profile(activities=activities(on_device)) as prof:
            done = calibrate(model, recipe, "bundled", Path(work) / "calibration", device)
            if on_device:
                torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    kernels, host = ranked(kernels_of(events), True), ranked(host_of(events), False)
    return {"model": str(model), "samples": samples, "device": device, "layers": done.layers, "wall_seconds": wall,
            "device_seconds": sum(row["seconds"] for row in kernels), "kernels": sum(row["count"] for row in kernels),
            "top_kernels": kernels[:top], "top_host": host[:top],
            "syncs": [row for row in host if row["name"].startswith(SYNCS)][:top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("decode", "calibrate"))
    parser.add_argument("path", type=Path, help="decode: an artifact; calibrate: a model folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16, help="decode: steps profiled (after 4 unprofiled ones)")
    parser.add_argument("--samples", type=int, default=128, help="calibrate: calibration windows of 256 tokens")
    parser.add_argument("--top", type=int, default=8, help="rows listed per table")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = (profile_decode(args.path, args.device, args.tokens, args.top) if args.what == "decode"
              else profile_calibration(args.path, args.samples, args.device, args.top))
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
