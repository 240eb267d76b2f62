"""What every benchmark stores beside its numbers: the exact command, its parameters, when, and on which machine.

    from provenance import start_run, write_results

    run = start_run(args)                                  # first thing in main(), after parsing the arguments
    write_results(args.out, results, run)                  # after every unit of work: a partial run keeps its rows
    write_results(args.out, results, run, complete=True)   # at the end

The results JSON gets a "provenance" list with one record per run that wrote its rows (a file merged from several
runs lists them all). benchmarks/run_all.py renders README's "Reproduce" line from these records and nothing else:
a results file without them is shown as "provenance not recorded".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hexq import __version__
from hexq.base.io import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The processor's model name (platform.processor() is empty or just the architecture on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict:
    """The machine this process runs on."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_usable": usable, "memory_bytes": memory_bytes(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def shown_path(path: Path) -> str:
    """A path inside the checkout relative to its root (so a command reads the same on every machine)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as it can be typed again from the checkout's root."""
    argv = sys.argv if argv is None else argv
    return shlex.join(["python", shown_path(Path(argv[0])), *argv[1:]])


def jsonable(value):
    if isinstance(value, Path):
        return shown_path(value)
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


def git_commit() -> str | None:
    """The checkout's commit, with "+changes" when files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def start_run(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    """The record of this run: command, parameters (every argument, defaults included), start time, machine."""
    return {"command": command_line(argv), "parameters": {k: jsonable(v) for k, v in sorted(vars(args).items())},
            "started": utc_now(), "machine": machine(), "hexq_version": __version__, "git_commit": git_commit(),
            "_clock": time.time()}


def write_results(path: Path, results: dict, run: dict, complete: bool = False, merged: bool = False,
                  keep=None) -> None:
    """Write `results` to `path` with this run's record, stamped with the time written and whether it is complete (a
    run that stops half-way leaves a file that says so). merged: the results keep rows of earlier runs from the same
    file, so their records stay too (only those `keep(record)` accepts, when given: the runs whose rows are left)."""
    record = {k: v for k, v in run.items() if k != "_clock"} | {
        "written": utc_now(), "seconds": round(time.time() - run["_clock"], 1), "complete": complete}
    earlier = []  # records of the runs whose rows this file still holds
    if merged and Path(path).is_file():
        try:
            earlier = [r for r in json.loads(Path(path).read_text()).get("provenance", [])
                       if isinstance(r, dict) and r.get("started") != record["started"] and (keep is None or keep(r))]
        except (OSError, ValueError, AttributeError):
            earlier = []
    write_json_atomic(path, {"provenance": [*earlier, record],
                             **{k: v for k, v in results.items() if k != "provenance"}})
