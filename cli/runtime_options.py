"""The options that shape a served artifact, shared by `hexq run` and `hexq serve` (one alias per option, one
builder of the RuntimeConfig), so both commands take the same flags with the same meaning."""

from __future__ import annotations

import os
from typing import Annotated

import typer

MemoryOpt = Annotated[str | None, typer.Option("--memory", help="One budget for the whole process: dense part + "
                                               "load scratch + KV cache + expert cache, e.g. 6GB.")]
FastTierOpt = Annotated[str | None, typer.Option("--fast-tier", help="Memory for the expert cache alone, e.g. 200MB "
                                                 "or 1.5GiB (default: all experts).")]
ContextOpt = Annotated[int | None, typer.Option("--context", "-c", help="Positions of one sequence (prompt + new "
                                                "tokens) the KV cache is planned for (default: the model's, at "
                                                "most 4096).", min=2)]
KvCacheOpt = Annotated[str, typer.Option("--kv-cache", help="The native decode step's KV cache: f16 (half the bytes, "
                                        "as llama.cpp's default) or f32.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Dense part and expanded matrices: bf16 or fp32.")]
CacheOpt = Annotated[str, typer.Option("--cache", help="What the expert cache holds: packed (the stored codes, "
                                       "computed from directly), or bf16 / fp32 matrices.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="Threads of the CPU kernels (default: every "
                                                "core).", min=1)]
KernelsOpt = Annotated[str, typer.Option("--kernels", help="How packed weights are computed: auto (the CPU kernels "
                                         "on the CPU, Triton on CUDA), cpu, triton, or torch (expand every matrix "
                                         "with torch ops).")]
DecodeOpt = Annotated[str, typer.Option("--decode", help="How a generated token is computed: auto (the native step "
                                        "where it covers the run, else the transformers model), native, or "
                                        "transformers. With --ppl, native scores every position after a window's "
                                        "first through the native step.")]
WarmOpt = Annotated[str, typer.Option("--warm", help="Warm start: none, or placement scheme 1 (paths), 2 "
                                      "(frequency), 3 (two-stage, pack's).")]
CostModelOpt = Annotated[bool, typer.Option("--cost-model/--no-cost-model", help="Per-miss fill or transient load "
                                            "by expected load time (off: every miss fills).")]
PolicyOpt = Annotated[str, typer.Option("--policy", help="Expert precision policy: static, context, online or "
                                        "depth.")]
PrefetchOpt = Annotated[bool, typer.Option("--prefetch/--no-prefetch", help="Look-ahead prefetch of the next "
                                           "layer's experts.")]
PrefetchTopOpt = Annotated[int, typer.Option("--prefetch-top", help="Experts predicted per layer ahead (default: "
                                             "twice the model's top-k, at most the cache's share per layer).",
                                             min=0)]
ModeOpt = Annotated[str, typer.Option("--mode", help="cache, or ondemand (no cache: load every expert at each "
                                      "use).")]


def runtime_config(*, memory: str | None, fast_tier: str | None, context: int | None, kv_cache: str, dtype: str,
                   cache: str,
                   threads: int | None, kernels: str, decode: str, warm: str, cost_model: bool, policy: str,
                   prefetch: bool, prefetch_top: int, mode: str, device: str):
    """The RuntimeConfig of the options above (sizes parsed, the device checked before anything loads)."""
    # Two thread pools share the cores while serving: torch's (OpenMP) and the packed kernels' own. OpenMP's default
    # is to spin after each parallel region, which takes the core the kernels' threads need next; passive waiting
    # keeps them out of each other's way. It must be set before torch loads OpenMP, i.e. here, before the imports.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # oneDNN keeps a JIT-compiled primitive per GEMM shape (1024 by default), and every prompt length brings new
    # shapes to a prefill: a server's resident set grew with each request of a new length (+285 MiB over 128 requests
    # of benchmarks/serve.py on a tiny model). 64 holds a prefill's shapes; read when the first primitive is made.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    from hexq.base.devices import resolve_device
    from hexq.base.units import parse_bytes
    from hexq.runtime.engine import RuntimeConfig

    resolve_device(device)
    return RuntimeConfig(memory_bytes=parse_bytes(memory) if memory is not None else None,
                         fast_tier_bytes=parse_bytes(fast_tier) if fast_tier is not None else None, policy=policy,
                         prefetch=prefetch, prefetch_top_t=prefetch_top, mode=mode, device=device, dtype=dtype,
                         cache=cache, warm=warm, admission=cost_model, kernels=kernels, threads=threads,
                         decode=decode, context=context, kv_cache=kv_cache)
