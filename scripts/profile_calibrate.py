"""Where `hexq calibrate` spends its time on a device: torch's profiler around one calibration, reported as the
kernels by device time, the operators by host time, and the host synchronisations (a GPU calibration bound by
launches or syncs shows it here, not in its stage times). scripts/gpu_check.py --profile runs it on the real-shaped
checkpoint; on a machine without a GPU it profiles the CPU operators alone (to check the script).

    python scripts/profile_calibrate.py MODEL [--samples 128] [--device cuda] [--top 10] [--json OUT]
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

from hexq.calib.pipeline import calibrate
from hexq.config.recipe_files import load_recipe

# operators that make the host wait for the device (a value read back, a blocking copy, an explicit wait)
SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
         "cudaEventSynchronize")


def summary(events, top: int, device: bool) -> dict:
    """The profiler's key_averages as three lists: kernels by device time, operators by host self time, syncs."""
    kernels = [e for e in events if device and e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    host = [e for e in events if e.device_type.name == "CPU"]

    def rows(selected, seconds) -> list[dict]:
        ranked = sorted(selected, key=seconds, reverse=True)
        return [{"name": e.key[:100], "seconds": seconds(e), "count": e.count} for e in ranked[:top]]

    return {"device_seconds": sum(e.self_device_time_total for e in kernels) / 1e6,
            "kernels": sum(e.count for e in kernels),
            "top_kernels": rows(kernels, lambda e: e.self_device_time_total / 1e6),
            "top_host": rows(host, lambda e: e.self_cpu_time_total / 1e6),
            "syncs": rows([e for e in host if e.key.startswith(SYNCS)], lambda e: e.self_cpu_time_total / 1e6)}


def profile_calibration(model: Path, samples: int, device: str, top: int) -> dict:
    recipe = load_recipe("experts-mixed")
    recipe = replace(recipe, calibration=replace(recipe.calibration, num_samples=samples))
    on_device = device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="hexq-profile-") as work:
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])) as prof:
            done = calibrate(model, recipe, "bundled", Path(work) / "calibration", device)
            if on_device:
                torch.cuda.synchronize()
        wall = time.perf_counter() - started
    return {"model": str(model), "samples": samples, "device": device, "layers": done.layers, "wall_seconds": wall,
            **summary(prof.key_averages(), top, on_device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--samples", type=int, default=128, help="calibration windows of 256 tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = profile_calibration(args.model, args.samples, args.device, args.top)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
