"""Runtime benchmark for `hexq run` on a model bigger than memory: speed, memory and disk reads under budgets.

    python benchmarks/runtime.py                                    # both reference models
    python benchmarks/runtime.py --models mixtral --decode 32
    python benchmarks/runtime.py --models --real /work/bench/q8.hexq --real-checkpoint /work/bench/qwen3-8 --decode 16

Artifacts: each reference model calibrated with experts-mixed on 32 windows and packed at 3.0 bits on average (made in
--work if missing); `--real` adds an artifact of a real-shaped checkpoint (scripts/make_checkpoint.py), with its
source checkpoint for the transformers baseline.

Every configuration runs in a fresh child process (torch threads: --threads), so that its peak RSS (VmHWM) and its
disk reads (/proc/self/io read_bytes) are its own. Each decode run feeds a 128-token held-out austen prompt and
generates --decode greedy tokens (tokens/s = 1 / median decode step). Sizes: "bf16 model" = the dense part plus every
expert in bf16 (what the source checkpoint holds); "bf16 experts" = the experts alone.

Configurations (hexq: `hexq.runtime.engine.Runtime`, bf16 dense part and fast tier unless said otherwise):
  resident          every expert loaded before timing: the all-in-memory reference
  ondemand          no fast tier: every expert read, unpacked and dequantized at each use
  lru               budget = a share of the bf16 experts, no warm start, every miss fills, no prefetch
  +warm             ... cache started with pack's two-stage placement (--warm 3)
  +cost             ... and the per-miss cost model (fill or transient load)
  hexq              ... and look-ahead prefetch: the default `hexq run`
  hexq warm 1 / 2   the default with placement scheme 1 (paths) or 2 (frequency) for the warm start
  hexq --memory     the default under one whole-process budget (dense part + scratch + fast tier)
  accelerate        transformers + accelerate with the same memory: device_map="auto", max_memory={"cpu": M},
                    offload_folder (what a Hugging Face user does when a model does not fit)
Each runs with the artifact (or checkpoint and offload folder) in the page cache ("hot") and with its pages dropped
first ("cold": os.posix_fadvise(POSIX_FADV_DONTNEED) on every file, after start-up and warm start, so the timed
generation reads from the disk). With --cgroup the --memory rows (hexq and accelerate) run once more, cold, inside a
memory cgroup limited to --memory plus the fixed overhead: the kernel counts the page cache the process fills against
that limit and reclaims or OOM-kills beyond it, as on a machine with less memory than the model (this machine has
more, so without it a process can lean on the page cache; needs a writable cgroup v1 or v2 memory controller).
Peak RSS is checked against --memory plus the fixed overhead, measured once per
model: the peak RSS of the same decode with a fast tier of one expert (prefetch worker running) minus its dense part,
scratch and that expert, i.e. the interpreter, torch, transformers, the tokenizer, the model skeleton, the worker
thread, activations and the KV cache (reported beside the VmHWM of a child that only imports and builds the skeleton
and tokenizer).

Also measured: perplexity of each reference model with the dense part and the fast tier in fp32 or bf16 (the four
combinations, all experts resident, --windows windows of 256 tokens of held-out austen); and the dequantization rate
of a miss on a Qwen3-30B-A3B expert (gate_up [1536, 2048], down [2048, 768], groups of 32) into bf16 and fp32 with
the CPU kernels (hexq.packed.cpu) and with torch ops, against a copy of the same output bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
SEQLEN, PROMPT_TOKENS = 256, 128
CGROUP_TIER = "disk, cgroup"  # cold, inside a memory cgroup of --memory + the fixed overhead (--cgroup)
FULL = {"warm": "3", "admission": True, "prefetch": True}
ABLATION = {"lru": {"warm": "none", "admission": False, "prefetch": False},
            "+warm": {"warm": "3", "admission": False, "prefetch": False},
            "+cost": {"warm": "3", "admission": True, "prefetch": False},
            "hexq": FULL}


# ------------------------------------------------------------------------------------------ measurements


def vm_hwm() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def bandwidth_tensor():
    """The tensor read_bandwidth reads: 2 GiB of float32 ones (several times any last-level cache)."""
    import torch

    return torch.ones(1 << 29, dtype=torch.float32, device="cpu")


def read_pass(data) -> float:
    """GB/s of one torch.sum over `data` (bandwidth_tensor), on torch's threads."""
    started = time.perf_counter()
    data.sum()
    return data.numel() * data.element_size() / (time.perf_counter() - started) / 1e9


def read_bandwidth(threads: int) -> float:
    """Memory read bandwidth in GB/s: torch.sum over a 2 GiB float32 tensor on `threads` threads (median of 5, after
    one warm-up)."""
    import torch

    torch.set_num_threads(threads)
    data = bandwidth_tensor()
    return statistics.median([read_pass(data) for _ in range(6)][1:])


def disk_read_bytes() -> int:
    return int(re.search(r"read_bytes:\s+(\d+)", Path("/proc/self/io").read_text()).group(1))


def files_under(path: Path) -> list[Path]:
    return [p for p in sorted(Path(path).rglob("*")) if p.is_file()] if Path(path).is_dir() else [Path(path)]


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache (written pages are flushed first, or they could not be dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: list[Path]) -> float:
    """Share of the files' pages in the page cache (mincore on a read-only mapping), to check that a drop worked."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    total = resident = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                continue
            try:
                if libc.mincore(address, size, vec) == 0:
                    resident += sum(v & 1 for v in vec)
                    total += pages
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def decode_steps(forward, first_ids, decode: int) -> tuple[float, float, list[int]]:
    """(ttft seconds, median decode step seconds, tokens) of a greedy decode: forward(ids, past) -> (logits, past)."""
    import torch

    started = time.perf_counter()
    logits, past = forward(first_ids, None)
    tokens, steps = [], []
    ttft = None
    for _ in range(decode):
        token = int(logits[0, -1].float().argmax())
        if ttft is None:
            ttft = time.perf_counter() - started
        tokens.append(token)
        step = time.perf_counter()
        logits, past = forward(torch.tensor([[token]], device="cpu"), past)
        steps.append(time.perf_counter() - step)
    return ttft, statistics.median(steps), tokens


# ------------------------------------------------------------------------------------------ memory cgroups


def cgroup_root() -> Path | None:
    """The writable memory-controller directory of this machine (cgroup v2 unified or v1 memory), or None."""
    candidates = ((Path("/sys/fs/cgroup"), "memory.max"), (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"))
    for root, limit in candidates:
        probe = root / f"hexq-bench-probe-{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            if (probe / limit).exists():
                return root
        finally:
            probe.rmdir()
    return None


class MemoryCgroup:
    """A memory cgroup of `limit` bytes (page cache included) for one child process; reports its peak and OOM kills."""

    def __init__(self, root: Path, limit: int):
        self.v2 = (root / "cgroup.controllers").exists()
        self.path = root / f"hexq-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))
        if not self.v2 and (self.path / "memory.memsw.limit_in_bytes").exists():
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no escape into swap

    def enter(self) -> None:
        """Called in the child between fork and exec: every page it touches from then on is charged here."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def report(self) -> dict:
        peak = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        events = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        kills = re.search(r"oom_kill (\d+)", events)
        return {"cgroup_peak_mib": int(peak.read_text()) / 2**20 if peak.exists() else float("nan"),
                "cgroup_oom_kills": int(kills.group(1)) if kills else 0}

    def remove(self) -> None:
        self.path.rmdir()


# ------------------------------------------------------------------------------------------ child processes


def child_hexq(spec: dict) -> dict:
    from hexq.runtime.engine import Runtime

    artifact = Path(spec["artifact"])
    files = files_under(artifact)
    options = dict(spec.get("options", {}))
    prefetch = options.pop("prefetch", True)
    mode = "ondemand" if spec["config"] == "ondemand" else "cache"
    if spec["cold"]:
        drop_page_cache(files)
    started = time.perf_counter()
    runtime = Runtime(artifact, fast_tier_bytes=spec.get("budget"), prefetch=prefetch and mode == "cache", mode=mode,
                      memory_bytes=spec.get("memory"), **options)
    if spec["config"] == "resident":
        runtime.fill_all()
    startup = time.perf_counter() - started
    if spec["cold"]:
        drop_page_cache(files)
    cached = cached_fraction([f for f in files if "experts" in f.parts])
    io_before, read_before = disk_read_bytes(), runtime.artifact.bytes_read
    _, stats = runtime.generate(spec["prompt"], spec["decode"])
    io_after = disk_read_bytes()
    result = stats.as_dict()
    runtime.close()
    cache = result["cache"]
    return {"decode_tokens_per_s": 1 / stats.tpot_seconds, "ttft_ms": stats.ttft_seconds * 1000,
            "tpot_ms": stats.tpot_seconds * 1000, "hit_rate": cache["hit_rate"],
            "bypass_loads": cache["bypass_loads"], "cost_model_declined": cache["admission_declined"],
            "artifact_read_mib": (stats.bytes_read - read_before) / 2**20,
            "disk_read_mib": (io_after - io_before) / 2**20, "expert_pages_cached_before": cached,
            "prefetch_recall": result["prefetch"]["recall"], "prefetch_precision": result["prefetch"]["precision"],
            "wait_s": cache["wait_seconds"], "peak_rss_mib": vm_hwm() / 2**20, "startup_s": startup,
            "dense_mib": stats.plan.dense_bytes / 2**20, "scratch_mib": stats.plan.scratch_bytes / 2**20,
            "budget_mib": stats.plan.fast_tier_bytes / 2**20, "warm_experts": stats.warm_experts,
            "kernel": stats.kernel_path,
            "cache_format": stats.cache_format}


def child_accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    checkpoint = Path(spec["checkpoint"])
    if spec["cold"]:
        drop_page_cache(files_under(checkpoint))
    with tempfile.TemporaryDirectory(dir=spec["work"], prefix="offload-") as offload:
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto",
                                                     max_memory={"cpu": spec["memory"]}, offload_folder=offload,
                                                     dtype=torch.bfloat16).eval()
        startup = time.perf_counter() - started
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        if spec["cold"]:
            drop_page_cache(files_under(checkpoint) + files_under(Path(offload)))
        placed = sorted(set(getattr(model, "hf_device_map", {}).values()))
        ids = tokenizer(spec["prompt"], return_tensors="pt").input_ids

        @torch.no_grad()
        def forward(step_ids, past):  # the head on a copy of the last position, as hexq's generate does
            out = model.model(step_ids, past_key_values=past, use_cache=True)
            return model.lm_head(out.last_hidden_state[0, -1:].clone())[None], out.past_key_values

        io_before = disk_read_bytes()
        ttft, tpot, _ = decode_steps(forward, ids, spec["decode"])
        io_after = disk_read_bytes()
    return {"decode_tokens_per_s": 1 / tpot, "ttft_ms": ttft * 1000, "tpot_ms": tpot * 1000,
            "disk_read_mib": (io_after - io_before) / 2**20, "peak_rss_mib": vm_hwm() / 2**20,
            "startup_s": startup, "devices": placed}


def child_overhead(spec: dict) -> dict:
    """The fixed overhead: interpreter, torch, transformers, hexq, the tokenizer and the meta skeleton, no weights."""
    import torch

    from hexq.artifact.reader import Artifact
    from hexq.runtime.engine import Runtime  # noqa: F401  (imported for its imports: what `hexq run` loads)
    from hexq.runtime.model import artifact_tokenizer, skeleton

    artifact = Artifact(spec["artifact"])
    skeleton(artifact, torch.device("cpu"), torch.bfloat16)
    artifact_tokenizer(artifact)
    return {"overhead_mib": vm_hwm() / 2**20}


def child_ppl(spec: dict) -> dict:
    from hexq.base.data import eval_text, tokenize
    from hexq.eval.run import runtime_perplexity
    from hexq.runtime.engine import Runtime

    with Runtime(spec["artifact"], dtype=spec["dtype"], cache=spec["cache"]) as runtime:
        runtime.fill_all()
        ids = tokenize(runtime.tokenizer, eval_text("austen"))
        value, scored, _ = runtime_perplexity(runtime, ids, SEQLEN, spec["windows"])
    return {"ppl_austen": value, "tokens_scored": scored}


CHILDREN = {"hexq": child_hexq, "accelerate": child_accelerate, "overhead": child_overhead, "ppl": child_ppl}


def child_env(serves_hexq: bool) -> dict[str, str]:
    """The environment of a benchmark's child process: this checkout first on PYTHONPATH; a child that serves with
    hexq waits in OpenMP passively, as `hexq run` sets it (cli/main.py run: torch's pool and the kernels' share the
    cores)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if serves_hexq:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_child(spec: dict, threads: int, cgroup: MemoryCgroup | None = None) -> dict:
    """Run one configuration in a fresh process (inside `cgroup` when given); its last stdout line is the JSON
    result."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), "--threads", str(threads)],
                          capture_output=True, text=True, env=child_env(serves_hexq=True), cwd=ROOT,
                          preexec_fn=cgroup.enter if cgroup else None)
    measured = cgroup.report() if cgroup else {}
    if done.returncode != 0:
        if measured.get("cgroup_oom_kills"):
            return {"error": "killed by the kernel's OOM killer at the cgroup's memory limit", **measured}
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail), **measured}
    return json.loads(done.stdout.strip().splitlines()[-1]) | measured


# ------------------------------------------------------------------------------------------ the dequantization rate


def dequant_rate(reps: int) -> list[dict]:
    """Output GB/s of a miss on a Qwen3-30B-A3B expert: kernel and torch path against a copy of the same bytes."""
    import torch
    from dequant_speed import GROUP_SIZE, SHAPES, median_seconds  # the expert shapes and timing of that benchmark

    from hexq.algos.quant import QuantSpec, quantize
    from hexq.packed.bitpack import DequantScratch, pack_bits
    from hexq.packed.cpu import load_cpu_kernels
    from hexq.packed.weight import PackedWeight, dequantize_packed_into

    kernels = load_cpu_kernels()
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for bits in (2, 3, 4):
        packed = []
        for shape in SHAPES.values():
            codes, meta = quantize(torch.randn(shape, generator=generator), QuantSpec(bits=bits, group_size=GROUP_SIZE,
                                                                                      symmetric=False))
            packed.append(PackedWeight(pack_bits(codes.to(torch.uint8), bits), meta.scale.half(), meta.zero.half(),
                                       bits, shape))
        for dtype in (torch.bfloat16, torch.float32):
            outs = [torch.empty(shape, dtype=dtype) for shape in SHAPES.values()]
            sources = [torch.empty_like(out) for out in outs]
            scratch = DequantScratch.for_shapes(list(SHAPES.values()), "cpu")
            nbytes = sum(out.numel() * out.element_size() for out in outs)

            copy, _ = median_seconds(lambda o=outs, s=sources: [a.copy_(b) for a, b in zip(o, s, strict=True)], reps)
            torch_path, _ = median_seconds(lambda o=outs, w=packed, c=scratch: [
                dequantize_packed_into(a, b, c) for a, b in zip(o, w, strict=True)], reps)
            row = {"bits": bits, "dtype": str(dtype).removeprefix("torch."), "out_mib": nbytes / 2**20,
                   "copy_ms": copy * 1000, "torch_ms": torch_path * 1000, "torch_over_copy": copy / torch_path}
            if kernels is not None:
                fast, _ = median_seconds(lambda o=outs, w=packed: [
                    kernels.dequantize(a, b) for a, b in zip(o, w, strict=True)], reps)
                row |= {"kernel_ms": fast * 1000, "kernel_over_copy": copy / fast,
                        "kernel_gbps": nbytes / fast / 1e9}
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ one model


def artifact_for(name: str, work: Path) -> Path:
    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import Calibration
    from hexq.config.recipe_files import load_recipe
    from hexq.pack.stage import Budget, pack

    out = work / f"{name}-3.0.hexq"
    if not (out / "manifest.json").exists():
        calib = work / f"{name}-mixed"
        recipe = load_recipe("experts-mixed")
        recipe = type(recipe)(**{**recipe.__dict__, "calibration": Calibration(num_samples=32, seqlen=256, seed=0)})
        calibrate(MODELS[name], recipe, "bundled", calib)
        pack(calib, out, budget=Budget(avg_bits=3.0), overwrite=True)
    return out


def sizes(artifact: Path) -> dict:
    """Bytes of the dense part and of every expert in bf16, and the artifact's prompt text."""
    import torch

    from hexq.artifact.reader import Artifact
    from hexq.base.data import eval_text, tokenize
    from hexq.runtime.model import artifact_tokenizer, skeleton
    from hexq.runtime.source import SlotSizes

    opened = Artifact(artifact)
    streamed = skeleton(opened, torch.device("cpu"), torch.bfloat16)
    experts_path = streamed.experts_path
    dense = sum(t.numel() * 2 for name, t in streamed.model.named_parameters()  # in bf16, as the checkpoint holds it
                if not (".layers." in name and f".{experts_path}." in name))
    experts = SlotSizes.of(opened, "bf16").largest_slot * len(opened.moe_layers) * opened.num_experts
    tokenizer = artifact_tokenizer(opened)
    austen = tokenize(tokenizer, eval_text("austen"))
    prompt = tokenizer.decode(austen[-PROMPT_TOKENS:])  # held-out text the perplexity windows do not use
    return {"dense_bytes": dense, "expert_bytes": experts, "model_bytes": dense + experts, "prompt": prompt,
            "experts": len(opened.moe_layers) * opened.num_experts}


def run_model(name: str, artifact: Path, checkpoint: Path, args, log, decode: int) -> dict:
    size = sizes(artifact)
    base = {"artifact": str(artifact), "prompt": size["prompt"], "decode": decode}
    imports = run_child({"kind": "overhead", "artifact": str(artifact)}, args.threads)["overhead_mib"]
    # The fixed overhead: what the process holds besides the budgeted bytes under the same workload, from a run with
    # the smallest fast tier (one expert; prefetch worker active): its peak RSS minus its dense part, scratch and
    # that expert. A budget-dependent leak cannot hide in it.
    one = size["expert_bytes"] // size["experts"]
    probe = run_child(base | {"kind": "hexq", "config": "overhead probe", "cold": False, "budget": one,
                              "options": FULL}, args.threads)
    overhead = probe["peak_rss_mib"] - probe["dense_mib"] - probe["scratch_mib"] - probe["budget_mib"]
    log(f"{name}: bf16 model {size['model_bytes'] / 2**20:.1f} MiB (dense {size['dense_bytes'] / 2**20:.1f}, "
        f"experts {size['expert_bytes'] / 2**20:.1f}); fixed overhead {overhead:.0f} MiB (imports and skeleton "
        f"alone {imports:.0f} MiB)")
    plan: list[tuple[str, str, dict]] = [("resident", "100% experts", {"options": {}}),
                                         ("ondemand", "-", {"options": {"warm": "none"}})]
    for fraction in args.expert_fractions:
        budget = int(size["expert_bytes"] * fraction)
        configs = ABLATION if fraction == 0.5 else {k: ABLATION[k] for k in ("lru", "hexq")}
        for config, options in configs.items():
            plan.append((config, f"{fraction:.0%} experts", {"budget": budget, "options": options}))
        if fraction == 0.5:
            for scheme in ("1", "2"):
                plan.append((f"hexq warm {scheme}", "50% experts",
                             {"budget": budget, "options": FULL | {"warm": scheme}}))
    for fraction in args.memory_fractions:
        memory = int(size["model_bytes"] * fraction)
        plan.append(("hexq --memory", f"{fraction:.0%} model", {"memory": memory, "options": FULL}))
        plan.append(("accelerate", f"{fraction:.0%} model", {"memory": memory, "kind": "accelerate"}))
    rows = []
    for config, budget_label, extra in plan:
        tiers = ["page cache", "disk"] if config != "resident" else ["page cache"]  # resident reads nothing
        limit = int(extra["memory"] + overhead * 2**20) if "memory" in extra else None  # the RSS (and cgroup) limit
        if limit and args.cgroup:
            tiers.append(CGROUP_TIER)
        for tier in tiers:
            spec = base | {"kind": "hexq", "config": config, "cold": tier != "page cache",
                           "checkpoint": str(checkpoint), "work": str(args.work)} | extra
            row = {"config": config, "budget": budget_label, "slow_tier": tier}
            cgroup = MemoryCgroup(args.cgroup, limit) if tier == CGROUP_TIER else None
            try:
                row |= run_child(spec, args.threads, cgroup)
            finally:
                if cgroup:
                    cgroup.remove()
            if limit:
                row["memory_mib"] = extra["memory"] / 2**20
                row["rss_limit_mib"] = limit / 2**20
                if "peak_rss_mib" in row:
                    row["rss_within_limit"] = row["peak_rss_mib"] <= row["rss_limit_mib"]
            rows.append(row)
            log(f"{name} {config} {budget_label} {row['slow_tier']}: " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("config", "budget", "slow_tier")))
    result = {"artifact": str(artifact), "checkpoint": str(checkpoint), "overhead_mib": overhead,
              "imports_and_skeleton_mib": imports,
              "dense_bytes": size["dense_bytes"], "expert_bytes": size["expert_bytes"],
              "model_bytes": size["model_bytes"], "rows": rows}
    if name in MODELS:
        ppl = []
        for dtype in ("fp32", "bf16"):
            for cache in ("fp32", "bf16", "packed"):
                got = run_child({"kind": "ppl", "artifact": str(artifact), "dtype": dtype, "cache": cache,
                                 "windows": args.windows}, args.threads)
                ppl.append({"dtype": dtype, "cache": cache, **got})
                log(f"{name} ppl dense {dtype} cache {cache}: {got}")
        result["ppl"] = ppl
    return result


def ratios(result: dict) -> dict:
    """The goals as ratios from this run."""
    def pick(config, budget, tier="page cache"):
        for row in result["rows"]:
            if row["config"] == config and row["budget"] == budget and row["slow_tier"] == tier and "error" not in row:
                return row
        return None

    out = {}
    resident = pick("resident", "100% experts")
    for tier in ("page cache", "disk", CGROUP_TIER):
        half, ondemand = pick("hexq", "50% experts", tier), pick("ondemand", "-", tier)
        if half and resident:
            out[f"hexq@50% experts / resident decode tok/s ({tier})"] = \
                half["decode_tokens_per_s"] / resident["decode_tokens_per_s"]
        if half and ondemand:
            out[f"hexq@50% experts / ondemand decode tok/s ({tier})"] = \
                half["decode_tokens_per_s"] / ondemand["decode_tokens_per_s"]
        if half and tier == "page cache":
            out["prefetch recall hexq@50% experts"] = half["prefetch_recall"]
        for fraction in ("50%", "25%"):
            ours = pick("hexq --memory", f"{fraction} model", tier)
            theirs = pick("accelerate", f"{fraction} model", tier)
            if ours and theirs:
                out[f"hexq / accelerate decode tok/s at {fraction} of the bf16 model ({tier})"] = \
                    ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
    checked = [row for row in result["rows"] if "rss_within_limit" in row and row["config"].startswith("hexq")]
    if checked:
        out["hexq --memory rows with peak RSS <= memory + overhead"] = \
            f"{sum(r['rss_within_limit'] for r in checked)} of {len(checked)}"
    return out


# ------------------------------------------------------------------------------------------ report

COLUMNS = ("decode_tokens_per_s", "ttft_ms", "hit_rate", "bypass_loads", "artifact_read_mib", "disk_read_mib",
           "prefetch_recall", "peak_rss_mib", "rss_limit_mib", "cgroup_peak_mib")


def render(results: dict) -> str:
    lines = []
    for row in results.get("dequant", []):
        if row["dtype"] == "bfloat16" and row["bits"] == 3:
            lines.append(f"Dequantizing a miss (Qwen3-30B-A3B expert, 3 bits, into bf16, {row['out_mib']:.1f} MiB "
                         f"out): kernel {row.get('kernel_ms', float('nan')):.2f} ms = "
                         f"{row.get('kernel_over_copy', float('nan')):.2f} of a memory copy ({row['copy_ms']:.2f} ms), "
                         f"torch ops {row['torch_ms']:.2f} ms = {row['torch_over_copy']:.2f}.")
    for name, result in results["models"].items():
        lines.append(f"\n{name}: bf16 model {result['model_bytes'] / 2**20:.1f} MiB (dense "
                     f"{result['dense_bytes'] / 2**20:.1f} MiB, experts {result['expert_bytes'] / 2**20:.1f} MiB); "
                     f"decode {result.get('decode', results['decode'])} tokens after a {PROMPT_TOKENS}-token prompt "
                     f"(tokens/s = 1 / median step); {results['threads']} torch thread(s); fixed overhead "
                     f"{result['overhead_mib']:.0f} "
                     f"MiB (imports and skeleton {result['imports_and_skeleton_mib']:.0f} MiB)")
        lines.append("| config | budget | slow tier | " + " | ".join(COLUMNS) + " |")
        lines.append("|---" * (len(COLUMNS) + 3) + "|")
        for row in result["rows"]:
            if "error" in row:
                # a child's stderr tail: show hexq's one-line error when there is one, not the frames before it
                message = row["error"].rsplit("HexqError: ", 1)[-1]
                lines.append(f"| {row['config']} | {row['budget']} | {row['slow_tier']} | error: "
                             f"{message[:160]} |")
                continue
            lines.append(f"| {row['config']} | {row['budget']} | {row['slow_tier']} | "
                         + " | ".join(f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                                      for c in COLUMNS) + " |")
        if result.get("ppl"):
            lines.append("\n| dense | fast tier | ppl austen |\n|---|---|---|")
            lines += [f"| {p['dtype']} | {p['cache']} | {p.get('ppl_austen', float('nan')):.3f} |"
                      for p in result["ppl"]]
        for key, value in result["ratios"].items():
            lines.append(f"- {key}: {value:.3f}" if isinstance(value, float) else f"- {key}: {value}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--real", type=Path, help="a real-shaped artifact to run as well")
    parser.add_argument("--real-checkpoint", type=Path, help="its source checkpoint (for the accelerate baseline)")
    parser.add_argument("--decode", type=int, default=96)
    parser.add_argument("--real-decode", type=int, default=32, help="tokens decoded on the real-shaped model")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15, help="repetitions of the dequantization timing")
    parser.add_argument("--expert-fractions", type=float, nargs="*", default=[0.25, 0.5],
                        help="expert-only budgets as shares of the bf16 experts (none: skip those rows)")
    parser.add_argument("--memory-fractions", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the forward pass (1 leaves the "
                        "second core of a 2-core machine to the prefetch worker)")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "runtime.json")
    parser.add_argument("--cgroup", action="store_true", help="also run the --memory rows cold inside a memory "
                        "cgroup of --memory + the fixed overhead (page cache counted)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cgroup and not args.child:
        args.cgroup = cgroup_root()
        if args.cgroup is None:
            parser.error("--cgroup needs a writable memory cgroup (v2 /sys/fs/cgroup or v1 /sys/fs/cgroup/memory)")

    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(CHILDREN[spec["kind"]](spec)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from provenance import start_run, write_results

    torch.manual_seed(0)
    record = start_run(args)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {"decode": args.decode, "windows": args.windows, "threads": torch.get_num_threads(), "models": {}}
    results["dequant"] = dequant_rate(args.reps)
    write_results(args.out, results, record)
    targets = [(name, artifact_for(name, args.work), MODELS[name]) for name in args.models]
    if args.real is not None:
        targets.append((f"real:{args.real.name}", args.real, args.real_checkpoint))
    for name, artifact, checkpoint in targets:
        decode = args.real_decode if name.startswith("real:") else args.decode
        result = run_model(name, artifact, checkpoint, args, lambda m: print(m, flush=True), decode)
        result["decode"] = decode
        result["ratios"] = ratios(result)
        results["models"][name] = result
        write_results(args.out, results, record)
    write_results(args.out, results, record, complete=True)
    print(render(results))


if __name__ == "__main__":
    main()
