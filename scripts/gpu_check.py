"""Every hexq command on a GPU, every number compared with the CPU's: the check scripts/gpu_check.sh runs.

For the reference model and a 2-layer Qwen3-30B-A3B-shaped checkpoint: calibrate (on the GPU, and the reference model on
the CPU too), the same calibration as one torchrun rank (NCCL), pack, eval (GPU and CPU), run (perplexity in bf16 and
fp32, greedy generation, decode speed) and export, then the GPU tests (pytest -m gpu). Prints one table: each number,
the CPU's, their relative difference and the tolerance it is held to (a row past its tolerance fails the check, exit 1).
Results go to a JSON file (README renders the table from it).

Tolerances. eval on GPU vs CPU: the same float32 streamed computation on two devices (different summation orders):
1e-4. run vs eval: the served model (bf16 or fp32, packed kernels) against the streamed float32 evaluation: 1e-3,
the runtime's accuracy goal. A CUDA-calibrated artifact against the CPU-calibrated one (GPTQ in float32 on two
devices takes different rounding paths): 1%. Timings are reported, not compared.

Run `DEVICE=cpu python scripts/gpu_check.py --size tiny` on any machine to check the script itself. The results file
records its provenance (benchmarks/provenance.py); copied to benchmarks/results/gpu_check.json, README and
docs/gpu.md render its table from it (benchmarks/run_all.py --render-only --only gpu_check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEXQ = [sys.executable, "-m", "hexq_cli.main"]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import start_run, write_results  # noqa: E402  (benchmarks/ is not a package)


class Check:
    def __init__(self, work: Path, device: str, run: dict) -> None:
        self.work, self.device, self.run = work, device, run
        self.rows: list[dict] = []
        self.started = time.perf_counter()
        self.log = (work / "gpu_check.log").open("a")

    def hexq(self, *args: str, timeout: int = 900, ranks: int = 0) -> tuple[float, str]:
        """Run one hexq command; (seconds, output). A failed command is a row of its own and raises. ranks: that
        many processes started by torchrun (torch.distributed.run) on this machine instead of one plain process."""
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                    str(free_port()), "--log-dir", str(self.work / "torchrun")] if ranks else [sys.executable]
        return self.command([*launcher, *HEXQ[1:], *args], f"hexq {' '.join(args)}", timeout)

    def profile(self, *args: str, out: Path, timeout: int = 900) -> dict:
        """scripts/hexq_profile.py with these arguments, its result written to `out` and returned."""
        self.command([sys.executable, str(ROOT / "scripts" / "hexq_profile.py"), *args, "--json", str(out)],
                     f"hexq_profile.py {' '.join(args)}", timeout)
        return json.loads(out.read_text())

    def command(self, argv: list[str], label: str, timeout: int) -> tuple[float, str]:
        """Run argv in the repository, logged under `label`; (seconds, output). A failed command raises."""
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        seconds = time.perf_counter() - started
        self.log.write(f"$ {label}  ({seconds:.1f} s, exit {done.returncode})\n{done.stdout}\n{done.stderr}\n")
        self.log.flush()
        if done.returncode != 0:
            raise RuntimeError(f"{label} failed: {done.stderr.strip().splitlines()[-1:]}")
        return seconds, done.stdout

    def compare(self, model: str, what: str, value: float, reference: float | None, tolerance: float | None,
                unit: str = "") -> None:
        change = None if reference is None else abs(value / reference - 1)
        ok = None if tolerance is None or change is None else change <= tolerance
        self.add(model, what, value, reference, change, tolerance, unit, ok)

    def add(self, model: str, what: str, value: float, reference: float | None = None, change: float | None = None,
            tolerance: float | None = None, unit: str = "", ok: bool | None = None) -> None:
        """One row: printed, and the results file rewritten (a run stopped by a time limit keeps what it measured)."""
        self.rows.append({"model": model, "what": what, "value": value, "reference": reference, "change": change,
                          "tolerance": tolerance, "unit": unit, "ok": ok})
        print(format_row(self.rows[-1]), flush=True)
        self.save()

    def save(self, complete: bool = False) -> None:
        import torch

        results = {"device": self.device, "seconds": time.perf_counter() - self.started, "rows": self.rows,
                   "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name() if self.device.startswith("cuda") else None}
        write_results(self.work / "gpu_check.json", results, self.run, complete=complete)

    def failed(self, model: str, exc: Exception) -> None:
        """A step that raised: a failing row of its own, and the check goes on with the next model."""
        self.add(model, f"FAILED: {str(exc)[:300]}", float("nan"), ok=False)

    def eval_ppl(self, target: Path, device: str, windows: int, seqlen: int) -> float:
        out = self.work / f"eval-{target.name}-{device}.json"
        self.hexq("eval", str(target), "-d", "austen", "-n", str(windows), "-L", str(seqlen), "--device", device,
                  "--json", str(out))
        return json.loads(out.read_text())["results"][0]["perplexity"]

    def run_ppl(self, artifact: Path, device: str, dtype: str, windows: int, seqlen: int) -> dict:
        out = self.work / f"run-{artifact.name}-{device}-{dtype}.json"
        self.hexq("run", str(artifact), "--ppl", "austen", "-n", str(windows), "-L", str(seqlen), "--device", device,
                  "--dtype", dtype, "--json", str(out))
        return json.loads(out.read_text())

    def generate(self, artifact: Path, device: str, tokens: int, decode: str = "auto") -> dict:
        out = self.work / f"gen-{artifact.name}-{device}-{decode}.json"
        self.hexq("run", str(artifact), "--prompt", "It is a truth universally acknowledged", "-m", str(tokens),
                  "--device", device, "--decode", decode, "--json", str(out))
        return json.loads(out.read_text())


def render(results: dict) -> str:
    """The check's table as README and docs/gpu.md show it (benchmarks/run_all.py --render-only --only gpu_check)."""
    failed = sum(row["ok"] is False for row in results["rows"])
    lines = [f"{results.get('gpu') or results['device']}, torch {results['torch']}: {len(results['rows'])} rows, "
             f"{failed} past tolerance or failed",
             "| model | what | value | CPU | change | tolerance |", "|---|---|---|---|---|---|"]
    return "\n".join(lines + [format_row(row).replace("|   of which", "| of which") for row in results["rows"]])


def format_row(row: dict) -> str:
    value = f"{row['value']:.4g}{row['unit']}"
    if row["reference"] is None:
        return f"| {row['model']} | {row['what']} | {value} | | | |"
    bound = "" if row["tolerance"] is None else f"<= {row['tolerance']:g} {'ok' if row['ok'] else 'FAIL'}"
    reference = f"{row['reference']:.4g}{row['unit']}"
    return f"| {row['model']} | {row['what']} | {value} | {reference} | {row['change']:.2e} | {bound} |"


def check_model(check: Check, name: str, model: Path, windows: int, seqlen: int, calib_windows: int,
                cpu_calibration: bool, decode_tokens: int, export: bool) -> None:
    device, work = check.device, check.work
    calibration = fresh(work / f"{name}-cal-{device}")
    seconds, _ = check.hexq("calibrate", str(model), "-r", "experts-mixed", "-n", str(calib_windows), "--device",
                            device, "--out", str(calibration), "--force")
    layers = json.loads((calibration / "manifest.json").read_text())["model"]["layers"]
    check.compare(name, f"calibrate on {device}: seconds per layer ({calib_windows} windows)", seconds / layers,
                  None, None, " s")
    timings = json.loads((calibration / "timings.json").read_text())
    walls = [seconds for name, seconds in timings.items() if name.startswith("layer_")]
    check.compare(name, "  of which the layer loop (mean per layer: load, stages, save)", sum(walls) / len(walls),
                  None, None, " s")
    # the last layer apart: the first pays the device's one-time costs (modules loaded, libraries' handles), which a
    # model of 60 layers amortizes
    last = max(name for name in timings if name.startswith("layer_"))
    check.compare(name, f"  of which the layer loop, last layer ({last})", timings[last], None, None, " s")
    stages = timings.get("stages", {})
    for stage in sorted({stage for layer in stages.values() for stage in layer}):
        check.compare(name, f"  of which {stage} (mean per layer; last layer {stages[last].get(stage, 0.0):.3g} s)",
                      sum(layer.get(stage, 0.0) for layer in stages.values()) / max(1, len(stages)), None, None, " s")
    artifact = work / f"{name}-{device}.hexq"
    check.hexq("pack", str(calibration), "--bits", "3", "--out", str(artifact), "--force")
    cpu_eval = check.eval_ppl(artifact, "cpu", windows, seqlen)
    check.compare(name, "eval, CPU", cpu_eval, None, None)
    if device != "cpu":
        check.compare(name, f"eval on {device} vs CPU", check.eval_ppl(artifact, device, windows, seqlen), cpu_eval,
                      1e-4)
    for dtype in ("bf16", "fp32"):
        served = check.run_ppl(artifact, device, dtype, windows, seqlen)
        check.compare(name, f"run --ppl on {device} ({dtype}, {served['stats']['kernel_path']}) vs eval",
                      served["perplexity"], cpu_eval, 1e-3)
    generated = check.generate(artifact, device, decode_tokens)
    stats = generated["stats"]
    check.compare(name, f"run decode on {device}: ms per token ({stats['kernel_path']}, {stats['decode_path']})",
                  1000 * stats["tpot_seconds"], None, None, " ms")
    if device != "cpu":  # the transformers decoder the CUDA graph step replaces, on the same artifact
        reference_path = check.generate(artifact, device, decode_tokens, decode="transformers")["stats"]
        check.compare(name, f"run decode on {device}: ms per token (--decode transformers)",
                      1000 * reference_path["tpot_seconds"], None, None, " ms")
    if device != "cpu":
        profile_rows(check, name, artifact)
    if device != "cpu" and export:  # a trained model: its greedy text means something
        reference = check.generate(artifact, "cpu", decode_tokens)
        same = common_prefix(generated["text"], reference["text"])
        check.compare(name, f"greedy text on {device}: characters equal to the CPU's", same,
                      len(reference["text"]), None)
    if cpu_calibration and device != "cpu":
        cpu_cal = fresh(work / f"{name}-cal-cpu")
        check.hexq("calibrate", str(model), "-r", "experts-mixed", "-n", str(calib_windows), "--device", "cpu",
                   "--out", str(cpu_cal), "--force")
        cpu_artifact = work / f"{name}-cpu.hexq"
        check.hexq("pack", str(cpu_cal), "--bits", "3", "--out", str(cpu_artifact), "--force")
        check.compare(name, f"artifact calibrated on {device} vs on CPU (eval, CPU)", cpu_eval,
                      check.eval_ppl(cpu_artifact, "cpu", windows, seqlen), 1e-2)
    if name == "qwen3moe":  # the distributed launch: NCCL on a GPU (gloo when checking the script), on the small model
        check_ranks(check, name, model, calibration, windows, seqlen, calib_windows, cpu_eval)
    if not export:
        return
    export = work / f"{name}-ct"
    check.hexq("export", str(artifact), "-o", str(export), "-n", "2", "-L", str(seqlen), "--force", "--json",
               str(work / f"export-{name}.json"))
    served = json.loads((work / f"export-{name}.json").read_text())["check"]["vs_served"]
    # the export publishes only within its own limits (relative L2 of the logits); the perplexity is shown against 1%
    check.compare(name, "export reloaded vs served (ppl)", served["ppl_model"], served["ppl_reference"], 1e-2)
    shutil.rmtree(export, ignore_errors=True)


def check_ranks(check: Check, name: str, model: Path, calibration: Path, windows: int, seqlen: int,
                calib_windows: int, single_eval: float) -> None:
    """The same calibration as one rank of a torchrun job (world size 1: NCCL on CUDA, gloo on the CPU): the rank
    path's collectives and file handling on this device, its artifact against the plain process's (the same
    arithmetic: equal within eval's own device tolerance), and its seconds per layer."""
    device, work = check.device, check.work
    ranked = fresh(work / f"{name}-cal-{device}-torchrun")
    seconds, _ = check.hexq("calibrate", str(model), "-r", "experts-mixed", "-n", str(calib_windows), "--device",
                            device, "--out", str(ranked), "--force", ranks=1)
    layers = json.loads((ranked / "manifest.json").read_text())["model"]["layers"]
    check.compare(name, f"calibrate under torchrun, 1 rank on {device}: seconds per layer", seconds / layers, None,
                  None, " s")
    files = sorted(calibration.glob("**/*.safetensors"))
    differing = [path for path in files if (ranked / path.relative_to(calibration)).read_bytes() != path.read_bytes()]
    named = ", ".join(f"{path.name.removesuffix('.safetensors')} {file_difference(path, ranked / path.name)}"
                      for path in differing)
    check.compare(name, f"  its tensor files differing from the plain process's (of {len(files)}){': ' * bool(named)}"
                  f"{named}", len(differing), None, None)
    artifact = work / f"{name}-{device}-torchrun.hexq"
    check.hexq("pack", str(ranked), "--bits", "3", "--out", str(artifact), "--force")
    check.compare(name, "  its artifact vs the plain process's (eval, CPU)", check.eval_ppl(artifact, "cpu", windows,
                  seqlen), single_eval, 1e-4)


def profile_rows(check: Check, name: str, artifact: Path, top: int = 5) -> None:
    """The decode step's kernels by device time per token (scripts/hexq_profile.py decode): where its time goes."""
    result = check.profile("decode", str(artifact), "--device", check.device, "--top", str(top),
                           out=check.work / f"profile-{artifact.name}.json", timeout=600)
    check.compare(name, f"decode step profiled ({result['profiled']}): device time per token, "
                  f"{result['launches_per_token']:.0f} kernels", result["ms_per_token"], None, None, " ms")
    for row in result["top"]:
        check.compare(name, f"  of which {row['name'][:60]} ({row['count']:.3g} per token)", 1e6 * row["seconds"],
                      None, None, " us")


def calibration_profile_rows(check: Check, name: str, model: Path, samples: int, top: int = 5) -> None:
    """One calibration under torch's profiler (scripts/hexq_profile.py calibrate): device time against wall time, the
    kernels that take it, the host operators, and how often the host waited for the device."""
    result = check.profile("calibrate", str(model), "--samples", str(samples), "--device", check.device, "--top",
                           str(top), out=check.work / f"profile-calibrate-{model.name}.json")
    check.compare(name, f"calibration profiled ({samples} windows, {result['layers']} layers): wall time",
                  result["wall_seconds"], None, None, " s")
    check.compare(name, f"  of which kernels on the device ({result['kernels']:.0f} launches)",
                  result["device_seconds"], None, None, " s")
    for kind, what in (("top_kernels", "kernel"), ("top_host", "host operator"), ("syncs", "host waits in")):
        for row in result[kind]:
            check.compare(name, f"  {what} {row['name'][:60]} (x{row['count']:.0f})", row["seconds"], None, None, " s")


def fresh(calibration: Path) -> Path:
    """The check's own calibration folder, emptied: `hexq calibrate` keeps a finished calibration of the same inputs
    ("nothing to do", --force or not), so a second check in the same --work would time nothing and report the first
    one's stage times."""
    shutil.rmtree(calibration, ignore_errors=True)
    return calibration


def file_difference(a: Path, b: Path) -> str:
    """Where two tensor files of one calibration differ: codes changed (of all), and the largest difference of a float
    tensor relative to its largest value."""
    from safetensors.torch import load_file

    first, second = load_file(a), load_file(b)
    codes = changed = 0
    worst = 0.0
    for key, x in first.items():
        y = second.get(key)
        if y is None or y.shape != x.shape:
            return f"(tensor {key} missing or reshaped)"
        if x.is_floating_point():
            worst = max(worst, float((x.double() - y.double()).abs().max() / x.double().abs().max().clamp(min=1e-30)))
        else:
            codes, changed = codes + x.numel(), changed + int((x != y).sum())
    return f"({changed} of {codes} codes, floats {worst:.1e})"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("OUT", "gpu-check")))
    parser.add_argument("--size", choices=("tiny", "real"), default="real",
                        help="real: the reference model and a 2-layer Qwen3-30B-A3B-shaped checkpoint; tiny: the "
                             "reference model at a few windows (to check the script).")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the real-shaped checkpoint's calibration (scripts/hexq_profile.py "
                             "calibrate; about a minute more on a GPU); with --size tiny, the reference model's")
    args = parser.parse_args()
    device = os.environ.get("DEVICE", "cuda")
    args.work.mkdir(parents=True, exist_ok=True)
    check = Check(args.work, device, start_run(args))
    print("| model | what | value | CPU | change | tolerance |\n|---|---|---|---|---|---|", flush=True)
    tiny = args.size == "tiny"
    try:
        check_model(check, "qwen3moe", ROOT / "models" / "hexq-tiny-qwen3moe", windows=4 if tiny else 16,
                    seqlen=256, calib_windows=8 if tiny else 32, cpu_calibration=not tiny,
                    decode_tokens=16 if tiny else 64, export=True)
    except Exception as exc:  # noqa: BLE001 - any failure is a row; the check goes on
        check.failed("qwen3moe", exc)
    if tiny and args.profile:
        try:
            calibration_profile_rows(check, "qwen3moe", ROOT / "models" / "hexq-tiny-qwen3moe", samples=8)
        except Exception as exc:  # noqa: BLE001 - any failure is a row; the check goes on
            check.failed("qwen3moe", exc)
    if not tiny:
        checkpoint = args.work / "qwen3-30b-a3b-2layers"
        try:
            if not checkpoint.exists():
                subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), "--family",
                                "qwen3_moe", "--size", "published", "--layers", "2", "--vocab", "8192", "--out",
                                str(checkpoint)], check=True, cwd=ROOT, capture_output=True)
            # a random-weight checkpoint: calibration time, eval/run agreement and decode speed mean something here,
            # its text and an export check do not (the export at real size is measured on the CPU: README)
            check_model(check, "qwen3-30b-a3b x2", checkpoint, windows=4, seqlen=256, calib_windows=128,
                        cpu_calibration=False, decode_tokens=32, export=False)
            if args.profile:
                calibration_profile_rows(check, "qwen3-30b-a3b x2", checkpoint, samples=128)
        except Exception as exc:  # noqa: BLE001 - any failure is a row; the check goes on
            check.failed("qwen3-30b-a3b x2", exc)
        shutil.rmtree(checkpoint, ignore_errors=True)
    if not args.skip_tests and device != "cpu":
        # --continue-on-collection-errors: a test module needing a package this machine lacks (gguf, say) must not
        # hide the GPU tests of the others
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                               "--continue-on-collection-errors", "tests"], capture_output=True, text=True, cwd=ROOT)
        check.log.write(done.stdout + done.stderr)
        summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
        check.add("tests", f"pytest -m gpu: {summary}", done.returncode, ok=done.returncode == 0)
    check.save(complete=True)
    failed = [row for row in check.rows if row["ok"] is False]
    print(f"\n{len(check.rows)} rows, {len(failed)} past tolerance or failed, "
          f"{time.perf_counter() - check.started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
