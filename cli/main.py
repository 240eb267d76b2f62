"""The `hexq` command. One function per command; rich output lives here only (hexq_cli.common has what the
commands share; hexq modules are imported inside each command, for start-up time)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hexq import __version__
from hexq.base.errors import HexqError
from hexq_cli.artifact_commands import export, inspect, report
from hexq_cli.common import (
    ActivationsOpt,
    BatchOpt,
    DeviceOpt,
    JsonOpt,
    ModelArg,
    RevisionOpt,
    SeqlenOpt,
    WindowsOpt,
    app,
    console,
    err_console,
    handle_errors,
    progress_bar,
    staged,
)
from hexq_cli.eval_command import eval_command
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
from hexq_cli.serve_command import serve


@app.command()
def version() -> None:
    """Print hexq's version."""
    console.print(f"hexq {__version__}")


def _print_version(value: bool) -> None:
    if value:
        version()
        raise typer.Exit()


@app.callback()
def main_options(
    show_version: Annotated[bool, typer.Option("--version", help="Print hexq's version and exit.",
                                               callback=_print_version, is_eager=True)] = False,
) -> None:
    """Quantize, calibrate and serve Mixture-of-Experts language models."""


@app.command()
@handle_errors
def calibrate(
    model: ModelArg,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe YAML file or bundled name (haq-w8a8, "
                                        "experts-mixed, w4a16-g32, rtn-w4a16).")] = "haq-w8a8",
    data: Annotated[str, typer.Option("--data", "-d", help="Calibration text: bundled, austen, pydocs, foldoc, "
                                      "a text/jsonl/parquet file, or a hub dataset name.")] = "bundled",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (resumed if interrupted).")] = Path(
        "calibration"),
    samples: Annotated[int | None, typer.Option("--samples", "-n", help="Override the recipe's number of "
                                                "calibration windows.", min=1)] = None,
    seqlen: Annotated[int | None, typer.Option("--seqlen", "-L", help="Override the recipe's window length.",
                                               min=2)] = None,
    batch_size: BatchOpt = 8,
    device: DeviceOpt = "auto",
    activation_memory: ActivationsOpt = "4GiB",
    force: Annotated[bool, typer.Option("--force", help="Replace an output folder holding another calibration (only "
                                        "one hexq wrote; never an input). One of the same model, data and recipe is "
                                        "kept: delete it to calibrate again.")] = False,
    export_target: Annotated[str | None, typer.Option("--export-target", help="Also make, for every routed expert, "
                                                      "a GPTQ replica on this serving grid for hexq export "
                                                      "(vllm: 4-bit symmetric groups of 128); sets the recipe's "
                                                      "experts.export_target.")] = None,
    revision: RevisionOpt = None,
) -> None:
    """Smoothing search, GPTQ, per-expert replica banks and loss tables, streamed one layer at a time. Under torchrun
    (`torchrun --nproc_per_node N --no-python hexq calibrate ...`) the routed experts are split across the ranks."""
    from dataclasses import replace

    from hexq.base.devices import resolve_device
    from hexq.base.units import parse_bytes
    from hexq.calib.pipeline import calibrate as run_calibration
    from hexq.config.recipe_files import load_recipe
    from hexq.model.folder import resolve_model

    resolve_device(device)  # a bad --device fails before anything is read
    shown = Path(str(model)).name
    model = resolve_model(model, revision)
    limit = parse_bytes(activation_memory)
    chosen = load_recipe(recipe)
    if samples or seqlen:
        calibration = replace(chosen.calibration, num_samples=samples or chosen.calibration.num_samples,
                              seqlen=seqlen or chosen.calibration.seqlen)
        chosen = replace(chosen, calibration=calibration)
    if export_target is not None:
        chosen = replace(chosen, experts=replace(chosen.experts, export_target=export_target))
    if os.environ.get("RANK", "0") != "0":  # one rank of a torchrun job: rank 0 shows the progress and the summary
        run_calibration(model, chosen, data, out, device, batch_size, None, limit, force)
        return
    with progress_bar() as bar:
        report = staged(bar, f"calibrate {shown} ({chosen.name}): layers")
        summary = run_calibration(model, chosen, data, out, device, batch_size, report, limit, force)
    if summary.resumed_from == -1:
        console.print(f"{out} already holds this calibration (same model, data and recipe); nothing to do")
        return
    resumed = f", resumed after layer {summary.resumed_from}" if summary.resumed_from else ""
    console.print(f"calibrated {summary.layers} layers into {out} in {summary.seconds:.1f}s{resumed}; "
                  f"{summary.fallback_experts} cold expert(s) used the layer-wide Hessian fallback")


app.command("eval")(eval_command)


@app.command("pack")
@handle_errors
def pack_command(
    calibration: Annotated[Path, typer.Argument(help="Calibration folder made by hexq calibrate (with replica "
                                                "banks, e.g. recipe experts-mixed).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact folder to write.")] = Path("model.hexq"),
    recipe: Annotated[str | None, typer.Option("--recipe", "-r", help="Take the pack section from this recipe "
                                               "(default: the calibration's recipe).")] = None,
    bits: Annotated[float | None, typer.Option("--bits", help="Average bits per expert in every layer, or over "
                                               "the whole model where the schedule is model (experts-mixed's); "
                                               "default: the recipe's pack.avg_bits.")] = None,
    expert_bytes: Annotated[str | None, typer.Option("--expert-bytes", help="Stored bytes for all routed experts of "
                                                     "the model, e.g. 3MB or 2.5MiB; split across layers by the "
                                                     "recipe's pack.schedule.")] = None,
    schedule: Annotated[str | None, typer.Option("--schedule", help="How the budget is split across layers: "
                                                 "uniform, cosine (--expert-bytes: deeper layers get less) or "
                                                 "model (not split: layers whose loss tables lose more at low "
                                                 "width get more; needs pack.order free).")] = None,
    bank: Annotated[str | None, typer.Option("--bank", help="Widths kept for every expert besides its allocated one, "
                                             "for run policies that change precision: widths (2,4), policy names "
                                             "(online, context, depth: what that policy needs) or all; and "
                                             "'export': the 4-bit replica of every expert hexq export must "
                                             "project (8-bit ones). Comma-separated. Default: the allocation "
                                             "only.")] = None,
    allow_skipping: Annotated[bool, typer.Option("--allow-skipping", help="Accept a budget below every expert at the "
                                                 "smallest stored width: met only by skipping experts (0 bits).")]
    = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing artifact.")] = False,
) -> None:
    """Importance, hot-expert placement, bit allocation and one packed, checksummed artifact."""
    from dataclasses import replace

    from hexq.base.units import format_bytes, parse_bytes
    from hexq.config.recipe_files import load_recipe
    from hexq.pack.stage import Budget, pack

    if bits is not None and expert_bytes is not None:
        raise HexqError("give either --bits (mean bits per expert) or --expert-bytes (bytes for the model), not both")
    settings = load_recipe(recipe).pack if recipe else None
    if schedule is not None:
        from hexq.calib.store import read_manifest

        base = settings or read_manifest(calibration).recipe.pack
        settings = replace(base, schedule=schedule)
    chosen = None  # the recipe's own pack.avg_bits, taken as meant
    if expert_bytes is not None:
        chosen = Budget(total_bytes=parse_bytes(expert_bytes), allow_skipping=allow_skipping)
    elif bits is not None:
        chosen = Budget(avg_bits=bits, allow_skipping=allow_skipping)
    banked = tuple(item.strip() for item in bank.split(",") if item.strip()) if bank else ()
    with progress_bar() as bar:
        task = bar.add_task(f"pack {calibration.name}", total=None)

        def report(stage: str, done: int, total: int) -> None:
            bar.update(task, description=f"pack {calibration.name}: {stage}", completed=done, total=total)

        summary = pack(calibration, out, settings, chosen, force, report, banked)
    console.print(f"packed {summary.layers} layers x {summary.experts} experts into {out}: "
                  f"{summary.average_bits:.3f} bits on average, experts at the allocation "
                  f"{format_bytes(summary.allocated_bytes)}, artifact {format_bytes(summary.artifact_bytes)} "
                  f"({summary.seconds:.1f}s)")
    if summary.without_4bit:
        err_console.print(f"note: {summary.without_4bit} experts are stored above 4 bits with no 4-bit replica; "
                          "`hexq export` writes a 4-bit layer holding one at 8 bits (GGUF Q8_0): pack with --bank "
                          "export to keep their 4-bit replicas for a smaller file")
    if summary.empty_layers:
        err_console.print(f"warning: the allocation skips every routed expert of layer(s) "
                          f"{', '.join(map(str, summary.empty_layers))}: those layers serve no MoE output")


app.command()(inspect)
app.command()(export)


def print_run_stats(stats: dict) -> None:
    cache, prefetch = stats["cache"], stats["prefetch"]
    table = Table(title="runtime")
    table.add_column("measure")
    table.add_column("value", justify="right")
    def mb(value: int) -> str:
        return f"{value / 2**20:.2f} MiB"

    memory = "" if stats["memory_bytes"] is None else f" of --memory {mb(stats['memory_bytes'])}"
    rows = [("memory plan", f"dense {mb(stats['dense_bytes'])} ({stats['dtype']}) + scratch "
                            f"{mb(stats['scratch_bytes'])} + KV {mb(stats['kv_bytes'])} ({stats['context']} "
                            f"positions) + fast tier {mb(stats['fast_tier_bytes'])}{memory}"),
            ("fast tier", f"{mb(stats['fast_tier_bytes'])} of {mb(stats['expert_bytes'])} ({stats['cache_format']}, "
                          f"{stats['warm_experts']} warm)"),
            ("compute", f"{stats['kernel_path']}, {stats['threads']} thread(s): {stats['gemv_rows']} rows from the "
                        f"codes, {stats['expanded_experts']} experts and {stats['expanded_dense']} dense products "
                        "expanded"),
            ("decode", stats["decode_path"]),
            ("expand from (tokens)", ", ".join(f"{kind} {'never' if n is None else n}"
                                                for kind, n in stats["expand_from"].items())),
            ("peak cached", mb(stats["peak_bytes"])),
            ("hits / misses", f"{cache['hits']} / {cache['misses']} ({cache['hit_rate']:.1%})"),
            ("per-layer hit rate", " ".join(f"{v:.0%}" for v in cache["layer_hit_rate"].values())),
            ("promotions / evictions", f"{cache['promotions']} / {cache['evictions']}"),
            ("bypass loads (cost model)", f"{cache['bypass_loads']} ({cache['admission_declined']})"),
            ("bytes moved / read", f"{mb(cache['bytes_moved'])} / {mb(stats['bytes_read'])}"),
            ("forward wait", f"{cache['wait_seconds']:.3f} s"),
            ("prefetch precision / recall", f"{prefetch['precision']:.1%} / {prefetch['recall']:.1%}")]
    if stats["peak_rss_bytes"] is not None:
        rows.append(("peak RSS", mb(stats["peak_rss_bytes"])))
    if stats["ttft_seconds"] is not None:
        rows += [("TTFT", f"{stats['ttft_seconds'] * 1000:.1f} ms"),
                 ("TPOT", "-" if stats["tpot_seconds"] is None else f"{stats['tpot_seconds'] * 1000:.1f} ms"),
                 ("tokens/s", f"{stats['tokens_per_second']:.1f}")]
    profile = stats.get("native_profile")
    if profile and profile["steps"]:
        rows.append(("native step (ms)", f"products {profile['products'] * 1e3:.2f}, attention "
                                         f"{profile['attention'] * 1e3:.2f}, glue {profile['glue'] * 1e3:.2f}"))
        if profile["missed"] or profile["predicted"]:
            rows.append(("native read-ahead", f"{profile['missed']:.1f} missed, {profile['predicted']:.1f} predicted"
                                              f"/token, {profile['ahead_precision']:.0%} routed"))
    for name, value in rows:
        table.add_row(name, value)
    err_console.print(table)


@app.command()
@handle_errors
def run(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder made by hexq pack.", show_default=False)],
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Generate a continuation of this text.")] = None,
    ppl: Annotated[str | None, typer.Option("--ppl", help="Measure perplexity on this corpus name or text file "
                                            "instead.")] = None,
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
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-m", help="Tokens to generate.", min=1)] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.", min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Sample from the smallest set of tokens whose probability "
                                         "reaches this (1: all).", min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens (0: all).", min=0)] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    prefetch: PrefetchOpt = True,
    prefetch_top: PrefetchTopOpt = 0,
    mode: ModeOpt = "cache",
    seqlen: SeqlenOpt = 256,
    windows: WindowsOpt = None,
    kl_against: Annotated[Path | None, typer.Option("--kl-against", help="With --ppl: also the KL divergence of the "
                                                    "served model's next-token distributions from this model's "
                                                    "(usually the original) on the same windows.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print TTFT, TPOT, tokens/s, hit rates, bytes moved, "
                                        "wait time.")] = False,
    device: DeviceOpt = "auto",
    json_out: JsonOpt = None,
) -> None:
    """Generate text or measure perplexity with the experts served from a mixed-precision cache."""
    if (prompt is None) == (ppl is None):
        raise HexqError("give exactly one of --prompt TEXT or --ppl DATA")
    config = runtime_config(memory=memory, fast_tier=fast_tier, context=context, kv_cache=kv_cache, dtype=dtype,
                            cache=cache, threads=threads, kernels=kernels, decode=decode, warm=warm,
                            cost_model=cost_model, policy=policy, prefetch=prefetch, prefetch_top=prefetch_top,
                            mode=mode, device=device)
    from hexq.base.data import eval_text, tokenize
    from hexq.base.io import write_json_atomic
    from hexq.eval.run import runtime_divergence, runtime_perplexity
    from hexq.model.folder import resolve_model
    from hexq.runtime.engine import Runtime
    from hexq.runtime.sampling import Sampling

    if kl_against is not None and ppl is None:
        raise HexqError("--kl-against goes with --ppl")
    reference = resolve_model(kl_against, None) if kl_against is not None else None

    sampling = Sampling(temperature, top_p, top_k, seed)
    with Runtime(artifact, config) as runtime:
        result: dict = {"artifact": str(artifact), "policy": policy, "mode": mode, "prefetch": prefetch,
                        "warm": warm, "cost_model": cost_model, "cache": cache}
        if prompt is not None:
            console.print(prompt, end="", style="dim", highlight=False)

            def stream(piece: str) -> None:
                console.print(piece, end="", highlight=False, soft_wrap=True)

            try:
                text, run_stats = runtime.generate(prompt, max_new_tokens, stream, sampling)
            finally:  # end the streamed line, so an error gets a line of its own
                console.print()
            result |= {"prompt": prompt, "text": text}
        else:
            ids = tokenize(runtime.tokenizer, eval_text(ppl))
            with progress_bar() as bar:
                task = bar.add_task(f"ppl {ppl}", total=None)
                value, scored, seconds = runtime_perplexity(
                    runtime, ids, seqlen, windows, lambda done, total: bar.update(task, completed=done, total=total),
                    decoded=decode == "native")
            run_stats = runtime.stats(tokens_per_second=scored / seconds)
            console.print(f"perplexity {value:.3f} on {ppl} (window {seqlen}, {scored:,} tokens scored, "
                          f"{scored / seconds:.0f} tokens/s)")
            result |= {"data": ppl, "perplexity": value, "seqlen": seqlen, "tokens_scored": scored}
            if reference is not None:
                with progress_bar() as bar:
                    task = bar.add_task(f"KL divergence from {reference.name}", total=None)
                    kl = runtime_divergence(runtime, eval_text(ppl), ids, seqlen, windows, reference,
                                            lambda done, total: bar.update(task, completed=done, total=total))
                summary = kl.summary()
                console.print(f"KL divergence from {reference.name}: mean {summary['kld_mean']:.5f}, p90 "
                              f"{summary['kld_p90']:.5f}, p99 {summary['kld_p99']:.5f} nats; top-1 agreement "
                              f"{summary['top1_agreement']:.2%}; perplexity ratio {summary['perplexity_ratio']:.4f}")
                result["kl"] = summary
        result["stats"] = run_stats.as_dict()
    if stats:
        print_run_stats(result["stats"])
    if json_out is not None:
        write_json_atomic(json_out, result)
        console.print(f"wrote {json_out}")


app.command()(report)
app.command()(serve)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
