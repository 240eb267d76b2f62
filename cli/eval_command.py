"""`hexq eval`: perplexity (and the KL divergence from another model) of a model, a calibration or an artifact,
streamed one layer at a time; with --baseline, the regression gate CI runs (hexq.eval)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hexq.base.errors import HexqError
from hexq_cli.common import (
    DEFAULT_EVAL_DATA,
    ActivationsOpt,
    BatchOpt,
    DeviceOpt,
    EvalTargetArg,
    JsonOpt,
    RevisionOpt,
    WindowsOpt,
    console,
    handle_errors,
    progress_bar,
    staged,
)


@handle_errors
def eval_command(
    model: EvalTargetArg,
    data: Annotated[list[str] | None, typer.Option("--data", "-d", help="Corpus name (wikitext2, austen, pydocs, "
                                                  "foldoc: held-out parts) or a text/jsonl/parquet file; "
                                                  "repeat for several.")] = None,
    seqlen: Annotated[int | None, typer.Option("--seqlen", "-L", help="Window length in tokens [default: 256, "
                                               "or the baseline's].", min=2)] = None,
    windows: WindowsOpt = None,
    batch_size: BatchOpt = 8,
    device: DeviceOpt = "auto",
    activation_memory: ActivationsOpt = "4GiB",
    json_out: JsonOpt = None,
    expert_bits: Annotated[int | None, typer.Option("--expert-bits", help="For a calibration folder with replica "
                                                    "banks: which replica the experts use.")] = None,
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Compare with this baseline (its data, "
                                                  "window length and windows) and exit 1 on a regression.")] = None,
    tolerance: Annotated[str, typer.Option("--tolerance", help="Allowed relative increase over the baseline, "
                                           "e.g. 0.5% or 0.005.")] = "0.5%",
    write_baseline: Annotated[Path | None, typer.Option("--write-baseline", help="Record the results as a "
                                                        "baseline file (explicit; never automatic).")] = None,
    revision: RevisionOpt = None,
    kl_against: Annotated[Path | None, typer.Option("--kl-against", help="Also the KL divergence of the next-token "
                                                    "distributions from this model's (folder or hub id, usually the "
                                                    "original), on the same windows: mean, p90, p99, top-1 "
                                                    "agreement; recorded in --write-baseline and gated by "
                                                    "--baseline.")] = None,
    kl_tolerance: Annotated[str, typer.Option("--kl-tolerance", help="Allowed relative increase of the mean KL "
                                              "divergence over the baseline's.")] = "10%",
    kl_floor: Annotated[str, typer.Option("--kl-floor", help="A mean KL divergence this far below the baseline's "
                                          "fails too: the quantization the baseline measured is no longer applied "
                                          "(or record a new baseline).")] = "40%",
) -> None:
    """Perplexity with the GPTQ protocol (exp of mean token NLL), streamed one layer at a time; with --kl-against,
    the KL divergence from another model; with --baseline, a regression gate for CI."""
    from hexq.base.devices import resolve_device
    from hexq.base.io import write_json_atomic
    from hexq.base.units import parse_bytes
    from hexq.eval import baseline as gate
    from hexq.eval.run import evaluate_model
    from hexq.model.folder import resolve_model

    resolved = resolve_device(device)  # a bad --device fails before anything is read
    model = resolve_model(model, revision)
    reference = resolve_model(kl_against, None) if kl_against is not None else None
    limit = parse_bytes(activation_memory)
    if baseline is not None and write_baseline is not None:
        raise HexqError("give --baseline (compare) or --write-baseline (record), not both")
    allowed = gate.parse_tolerance(tolerance)
    allowed_kl = gate.parse_tolerance(kl_tolerance)
    floor_kl = gate.parse_tolerance(kl_floor)
    recorded_kl = None
    if baseline is not None:
        recorded, reference_ppl = gate.read_baseline(baseline)
        recorded_kl = gate.read_kl(baseline)
        protocol = gate.resolve_protocol(recorded, data, seqlen, windows)
        if recorded_kl is not None:
            if reference is not None and Path(recorded_kl.against) != reference:
                raise HexqError(f"--kl-against {reference} differs from the baseline's {recorded_kl.against}")
            reference = resolve_model(Path(recorded_kl.against), None)
    else:
        protocol = gate.Protocol(tuple(data or DEFAULT_EVAL_DATA), seqlen or 256, windows)
    with progress_bar() as bar:
        report = staged(bar, f"eval {model.name}: layers")
        rows = evaluate_model(model, list(protocol.data), protocol.seqlen, protocol.windows, batch_size, resolved,
                              report, expert_bits, limit, reference)
    now = {row.data: row.result.perplexity for row in rows}
    now_kl = {row.data: row.divergence["kld_mean"] for row in rows if row.divergence is not None}
    table = Table(title=f"perplexity of {model.name} (window {protocol.seqlen})")
    for column in ("data", "perplexity", "windows", "tokens scored"):
        table.add_column(column, justify="left" if column == "data" else "right")
    for row in rows:
        r = row.result
        table.add_row(row.data, f"{r.perplexity:.3f}", str(r.windows), f"{r.tokens_scored:,}")
    if baseline is None:
        console.print(table)
    if reference is not None:
        console.print(divergence_table(rows, model.name, reference.name))
    if json_out is not None:
        write_json_atomic(json_out, {"model": str(model), "results": [row.as_dict() for row in rows]})
        console.print(f"wrote {json_out}")
    if write_baseline is not None:
        kl = gate.KLBaseline(str(kl_against), now_kl) if kl_against is not None else None
        gate.write_baseline(write_baseline, str(model), protocol, now, kl)
        console.print(f"recorded baseline {write_baseline}")
    if baseline is not None:
        comparisons = [(c, allowed, "perplexity") for c in gate.compare(reference_ppl, now, allowed)]
        if recorded_kl is not None:
            comparisons += [(c, allowed_kl, "mean KLD") for c in gate.compare(recorded_kl.kld_mean, now_kl,
                                                                             allowed_kl, floor_kl)]
        verdict = Table(title=f"{model.name} vs baseline {baseline} (window {protocol.seqlen}, "
                              f"{rows[0].result.windows} windows)")
        for column in ("data", "figure", "baseline", "now", "change", "limit", "status"):
            verdict.add_column(column, justify="left" if column in ("data", "figure", "status") else "right")
        for c, _, figure in comparisons:
            status = ("[bold red]REGRESSION[/]" if c.regressed else "[bold red]VANISHED[/]" if c.vanished else "ok")
            digits = 3 if figure == "perplexity" else 5
            verdict.add_row(c.data, figure, f"{c.baseline:.{digits}f}", f"{c.now:.{digits}f}", f"{c.change:+.2%}",
                            f"{c.limit:.{digits}f}", status)
        console.print(verdict)
        worse = [f"{c.data} ({figure}, more than {limit:.2%} above)" for c, limit, figure in comparisons
                 if c.regressed]
        worse += [f"{c.data} ({figure}, more than {floor_kl:.0%} below: is the quantization still applied? If this "
                  "is an improvement, record a new baseline)" for c, _, figure in comparisons if c.vanished]
        if worse:
            raise HexqError(f"regression against {baseline} on {', '.join(worse)}")


def divergence_table(rows, name: str, reference: str) -> Table:
    table = Table(title=f"KL divergence of {name} from {reference} (nats per token)")
    for column in ("data", "ref. ppl", "ppl ratio", "mean", "p90", "p99", "top-1 agree"):
        table.add_column(column, justify="left" if column == "data" else "right")
    for row in rows:
        kl = row.divergence
        table.add_row(row.data, f"{kl['reference_perplexity']:.3f}", f"{kl['perplexity_ratio']:.4f}",
                      f"{kl['kld_mean']:.5f}", f"{kl['kld_p90']:.5f}", f"{kl['kld_p99']:.5f}",
                      f"{kl['top1_agreement']:.2%}")
    return table
