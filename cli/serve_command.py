"""`hexq serve`: the artifact behind an OpenAI-compatible HTTP API (hexq.serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hexq.base.errors import HexqError
from hexq_cli.common import DeviceOpt, console, err_console, handle_errors
from hexq_cli.runtime_options import (
    CacheOpt,
    ContextOpt,
    CostModelOpt,
    DecodeOpt,
    DtypeOpt,
    FastTierOpt,
    KernelsOpt,
    KvCacheOpt,
    MemoryOpt,
    ModeOpt,
    PolicyOpt,
    PrefetchOpt,
    PrefetchTopOpt,
    ThreadsOpt,
    WarmOpt,
    runtime_config,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@handle_errors
def serve(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder made by hexq pack.", show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default; 0.0.0.0 for every "
                                      "interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.", min=1, max=65535)] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="HEXQ_API_KEY", help="Require this key "
                                                "(Authorization: Bearer KEY) on every request but /health; also "
                                                "read from HEXQ_API_KEY.", show_default=False)] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="The model id clients send and "
                                                   "/v1/models lists (default: the artifact folder's name).")] = None,
    chat_template: Annotated[Path | None, typer.Option("--chat-template", help="A Jinja chat template file for "
                                                       "/v1/chat/completions (default: the tokenizer's own).",
                                                       exists=True, dir_okay=False)] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait while one is generated; "
                                           "more are answered 503.", min=0)] = 64,
    max_body: Annotated[str, typer.Option("--max-body", help="Largest request body, e.g. 1MB.")] = "1MiB",
    memory: MemoryOpt = None,
    fast_tier: FastTierOpt = None,
    context: ContextOpt = None,
    kv_cache: KvCacheOpt = "f16",
    dtype: DtypeOpt = "bf16",
    cache: CacheOpt = "packed",
    threads: ThreadsOpt = None,
    kernels: KernelsOpt = "auto",
    decode: DecodeOpt = "auto",
    warm: WarmOpt = "3",
    cost_model: CostModelOpt = True,
    policy: PolicyOpt = "static",
    prefetch: PrefetchOpt = True,
    prefetch_top: PrefetchTopOpt = 0,
    mode: ModeOpt = "cache",
    device: DeviceOpt = "auto",
) -> None:
    """Serve the artifact over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics), one sequence at a time, within --memory."""
    config = runtime_config(memory=memory, fast_tier=fast_tier, context=context, kv_cache=kv_cache, dtype=dtype,
                            cache=cache, threads=threads, kernels=kernels, decode=decode, warm=warm,
                            cost_model=cost_model, policy=policy, prefetch=prefetch, prefetch_top=prefetch_top,
                            mode=mode, device=device)
    from hexq.base.devices import peak_rss_bytes
    from hexq.base.units import parse_bytes
    from hexq.runtime.engine import Runtime
    from hexq.serve.app import serve as run_server

    template = chat_template.read_text() if chat_template is not None else None
    max_body_bytes = parse_bytes(max_body)
    if max_body_bytes < 1024:
        raise HexqError(f"--max-body {max_body}: give at least 1KB")
    _check_port(host, port)
    _import_family(artifact)
    startup_rss = peak_rss_bytes()  # the interpreter and libraries, before anything of the artifact
    name = model_name or Path(artifact).resolve().name
    with Runtime(artifact, config) as runtime:
        memory = runtime.plan
        plan = (f"dense {memory.dense_bytes / 2**20:.1f} MiB + scratch {memory.scratch_bytes / 2**20:.1f} MiB + KV "
                f"{memory.kv_bytes / 2**20:.1f} MiB ({memory.context} positions) + fast tier "
                f"{memory.fast_tier_bytes / 2**20:.1f} MiB")
        console.print(f"serving {name} at http://{_url_host(host)}:{port}/v1 ({runtime.decode_path}; {plan}); "
                      "Ctrl-C stops", highlight=False, soft_wrap=True)
        if host not in LOOPBACK and api_key is None:
            err_console.print(f"[yellow]warning:[/] listening on {host} without --api-key: anyone who reaches this "
                              "port can use the model", highlight=False)
        run_server(runtime, host, port, model_name=name, api_key=api_key, max_queue=max_queue,
                   max_body_bytes=max_body_bytes, chat_template=template, startup_rss=startup_rss)


def _import_family(artifact: Path) -> None:
    """Import the artifact's transformers family module now (~200 MB of library code), so that the resident set
    measured at start holds every library the runtime needs and what the artifact adds is measured apart."""
    import importlib
    import json

    try:
        model_type = json.loads((Path(artifact) / "config.json").read_text())["model_type"]
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except (OSError, ValueError, KeyError, ImportError, TypeError):
        pass  # the Runtime names what is wrong with the artifact


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _check_port(host: str, port: int) -> None:
    """A one-line error now, not after the artifact has loaded, when the address cannot be bound."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise HexqError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
