"""Benchmark results carry their own provenance, and README's line under each table is rendered from it alone."""

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """benchmarks/provenance.py and benchmarks/run_all.py, imported the way the scripts import them."""
    sys.path.insert(0, str(BENCHMARKS_DIR))
    try:
        import run_all

        import provenance
    finally:
        sys.path.remove(str(BENCHMARKS_DIR))
    return provenance, run_all


def test_a_run_records_command_parameters_machine_and_times(bench, tmp_path):
    provenance, _ = bench
    args = argparse.Namespace(windows=3, models=["qwen3moe"], out=BENCHMARKS_DIR / "results" / "x.json")
    argv = [str(BENCHMARKS_DIR / "pack_quality.py"), "--windows", "3", "--models", "qwen3moe"]
    run = provenance.start_run(args, argv)
    provenance.write_results(tmp_path / "x.json", {"rows": [1]}, run)
    partial = json.loads((tmp_path / "x.json").read_text())
    provenance.write_results(tmp_path / "x.json", {"rows": [1, 2]}, run, complete=True)
    written = json.loads((tmp_path / "x.json").read_text())
    assert partial["provenance"][0]["complete"] is False and partial["rows"] == [1]
    (record,) = written["provenance"]
    assert written["rows"] == [1, 2] and record["complete"] is True
    assert record["command"] == "python benchmarks/pack_quality.py --windows 3 --models qwen3moe"
    assert record["parameters"] == {"models": ["qwen3moe"], "out": "benchmarks/results/x.json", "windows": 3}
    machine = record["machine"]
    assert {"platform", "processor", "cpu_count", "memory_bytes", "torch"} <= set(machine)
    assert machine["cpu_count"] >= 1 and machine["memory_bytes"] > 2**20 and machine["torch"]
    assert record["started"] <= record["written"] and record["seconds"] >= 0
    assert "_clock" not in record


def test_readme_line_is_the_recorded_run_not_this_machine(bench):
    provenance, run_all = bench
    run = {"command": "python benchmarks/placement.py --models mixtral", "started": "2026-11-20T10:00:00Z",
           "seconds": 600, "complete": True, "hexq_version": "0.1.0", "git_commit": "0123456789abcdef0123",
           "machine": {"processor": "Imaginary CPU 9000", "cpu_count": 64, "cpus_usable": 64,
                       "memory_bytes": 512 * 2**30, "cuda": None, "platform": "Linux-test", "torch": "2.13.0",
                       "torch_threads": 1}}
    line = run_all.provenance_line("placement", {"provenance": [run]})
    assert line.startswith("Reproduce: `python benchmarks/placement.py --models mixtral` (started 2026-11-20T10:00:00Z")
    assert "Imaginary CPU 9000, 64 CPUs (64 usable), 512.0 GiB" in line and "0123456789ab" in line
    assert provenance.cpu_model() not in line
    two = run_all.provenance_line("placement", {"provenance": [run, run | {"complete": False}]})
    assert two.startswith("Reproduce (2 runs): ") and "stopped before the end" in two


def test_results_without_provenance_say_so(bench):
    provenance, run_all = bench
    for results in ({"rows": []}, {"provenance": "yesterday"}, {"machine": "x86_64, 2 cores", "rows": []}):
        line = run_all.provenance_line("calibrate_cost", results)
        assert "provenance not recorded" in line and "Reproduce" not in line
        assert provenance.cpu_model() not in line
    assert "'x86_64, 2 cores'" in line  # what the old file did record is shown as such


def test_every_benchmark_writes_through_the_provenance_helper(bench):
    _, run_all = bench
    for script, _ in run_all.BENCHMARKS.values():
        source = (BENCHMARKS_DIR / script).read_text()
        assert "start_run(args" in source and "complete=True" in source, script
        assert "write_json_atomic" not in source, script  # results written without their provenance


def test_a_conversion_that_dies_leaves_no_file(tmp_path):
    """benchmarks/engines.py takes a llama.cpp conversion that exists as made: one that died half-way (a full disk)
    must leave nothing under its name, and one that finished must be there whole."""
    sys.path.insert(0, str(BENCHMARKS_DIR))
    try:
        import engines
    finally:
        sys.path.remove(str(BENCHMARKS_DIR))
    target = tmp_path / "model-Q4_0.gguf"
    with pytest.raises(OSError), engines.published(target) as partial:
        partial.write_bytes(b"half")
        raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []
    with engines.published(target) as partial:
        partial.write_bytes(b"whole")
    assert list(tmp_path.iterdir()) == [target] and target.read_bytes() == b"whole"
