"""kill -9 in the middle of `hexq calibrate` and `hexq pack`: nothing appears under the final name, the previous
output (if any) stays whole, and the next run resumes (calibrate) or cleans up and finishes (pack).

The child process runs the real CLI with one pause injected after the first file of interest is written, so the kill
lands mid-run deterministically; SIGKILL leaves no chance for cleanup code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hexq.base.errors import HexqError
from hexq.calib.pipeline import calibrate
from hexq.pack.stage import Budget, pack
from tests.conftest import mixed_recipe

ROOT = Path(__file__).resolve().parent.parent

# Run `hexq ARGS` with `module.function` replaced by a version that, after its `calls`-th call, says so in a flag file
# and sleeps (the test kills the process then).
CHILD = """
import importlib, sys, time
from pathlib import Path
module, name, calls, flag = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
target = importlib.import_module(module)
real = getattr(target, name)
seen = []
def paused(*args, **kwargs):
    result = real(*args, **kwargs)
    seen.append(1)
    if len(seen) == calls:
        flag.write_text("written")
        time.sleep(60)
    return result
setattr(target, name, paused)
from hexq_cli.main import app
app(sys.argv[5:], standalone_mode=True)
"""


def run_until_paused(tmp_path: Path, module: str, name: str, calls: int, *args: str,
                     while_paused=None) -> subprocess.Popen:
    flag = tmp_path / "paused.flag"
    child = subprocess.Popen([sys.executable, "-c", CHILD, module, name, str(calls), str(flag), *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=os.environ | {"PYTHONPATH": str(ROOT)})
    deadline = time.time() + 120
    while not flag.exists():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.time() < deadline, "the child never reached the pause"
        time.sleep(0.05)
    try:
        if while_paused is not None:
            while_paused()
    finally:
        child.send_signal(signal.SIGKILL)
    child.wait()
    return child


def test_kill_9_during_calibrate_then_the_rerun_resumes(tiny_qwen3moe, tmp_path):
    out = tmp_path / "cal"
    recipe = tmp_path / "recipe.yaml"
    from hexq.config.recipe import recipe_to_dict

    recipe.write_text(json.dumps(recipe_to_dict(mixed_recipe())))  # JSON is YAML
    def second_writer():  # the running calibration holds the output's lock: a second one is refused at once
        with pytest.raises(HexqError, match="another hexq process"):
            calibrate(tiny_qwen3moe, mixed_recipe(), "bundled", out)

    # killed right after layer 0 was recorded (the second progress write: the first marks the start)
    run_until_paused(tmp_path, "hexq.calib.pipeline", "write_progress", 2, "calibrate", str(tiny_qwen3moe), "-r",
                     str(recipe), "-o", str(out), "--device", "cpu", while_paused=second_writer)
    partial = tmp_path / ".cal.partial"
    assert not out.exists() and (partial / "layer_000.safetensors").is_file()
    assert not (partial / "layer_001.safetensors").exists()
    # the unfinished layers belong to this recipe: another recipe (here another damping) may not resume them
    from dataclasses import replace

    other = replace(mixed_recipe(), weights=replace(mixed_recipe().weights, damp=0.02))
    with pytest.raises(HexqError, match="unfinished calibration of a different recipe"):
        calibrate(tiny_qwen3moe, other, "bundled", out)
    text = tmp_path / "other.txt"  # nor other calibration text
    text.write_text((ROOT / "calib_data" / "foldoc.txt").read_text()[:20000])
    with pytest.raises(HexqError, match="unfinished calibration of a different calibration text"):
        calibrate(tiny_qwen3moe, mixed_recipe(), str(text), out)
    summary = calibrate(tiny_qwen3moe, mixed_recipe(), "bundled", out)
    assert summary.resumed_from == 1 and (out / "manifest.json").is_file() and not partial.exists()


def test_kill_9_during_pack_keeps_the_previous_artifact_and_the_next_run_cleans_up(mixed_calibration, tmp_path):
    out = tmp_path / "model.hexq"
    pack(mixed_calibration[0], out, budget=Budget(avg_bits=3.0))
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    child = run_until_paused(tmp_path, "hexq.artifact.format", "save_tensors", 1, "pack", str(mixed_calibration[0]),
                             "-o", str(out), "--bits", "2.5", "--force")
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    stale = tmp_path / f".model.hexq.tmp-{child.pid}"
    assert stale.is_dir()
    pack(mixed_calibration[0], out, budget=Budget(avg_bits=2.5), overwrite=True)
    assert not stale.exists() and json.loads((out / "manifest.json").read_text())["allocation"]["average_bits"] <= 2.5
