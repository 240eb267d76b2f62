"""Evaluate a model on several texts with the perplexity protocol: the library entry behind `hexq eval`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hexq.data import eval_text, tokenize
from hexq.errors import HexqError
from hexq.eval.perplexity import PerplexityResult, make_windows, perplexity
from hexq.models import load_model


@dataclass(frozen=True)
class EvalRow:
    data: str
    result: PerplexityResult

    def as_dict(self) -> dict:
        return {"data": self.data, **asdict(self.result)}


def load_eval_target(path: Path, device: str | None, expert_bits: int | None):
    """(model, tokenizer) for a HuggingFace model folder, a hexq calibration folder or a packed artifact (served by
    the runtime, `hexq run`'s code path, with the static policy and room for every expert)."""
    if (path / "manifest.json").exists() and '"hexq-artifact"' in (path / "manifest.json").read_text():
        from hexq.runtime.engine import Runtime

        if expert_bits is not None:
            raise HexqError("--expert-bits applies to a calibration folder; an artifact runs at its allocation")
        runtime = Runtime(path, device=device)
        return runtime.model, runtime.tokenizer
    if (path / "manifest.json").exists():
        from hexq.calib.pipeline import load_calibrated

        model, tokenizer, _ = load_calibrated(path, device, expert_bits)
        return model, tokenizer
    if expert_bits is not None:
        raise HexqError("--expert-bits applies to a calibration folder, not to a model folder")
    model, tokenizer, _ = load_model(path, device)
    return model, tokenizer


def evaluate_model(model_path: str | Path, data: list[str], seqlen: int, max_windows: int | None, batch_size: int,
                   device: str | None = None,
                   progress: Callable[[str, int, int], None] | None = None,
                   expert_bits: int | None = None) -> list[EvalRow]:
    """Perplexity of a model folder, or of a calibration folder's quantized model, on each data source (corpus
    name or file), same protocol for all."""
    model, tokenizer = load_eval_target(Path(model_path), device, expert_bits)
    token_streams = {source: tokenize(tokenizer, eval_text(source)) for source in data}
    rows = []
    for source, ids in token_streams.items():
        report = None if progress is None else (lambda done, total, s=source: progress(s, done, total))
        rows.append(EvalRow(source, perplexity(model, ids, seqlen, max_windows, batch_size, report)))
    return rows


def runtime_perplexity(runtime, ids: torch.Tensor, seqlen: int, max_windows: int | None,
                       progress: Callable[[int, int], None] | None = None) -> tuple[float, int, float]:
    """(perplexity, tokens scored, seconds) of a hexq.runtime.engine.Runtime with the GPTQ protocol (the windows of
    `make_windows`), one window per forward pass so that the precision policy sees each as a sequence."""
    windows = make_windows(ids, seqlen, max_windows)
    nll, started = 0.0, time.perf_counter()
    for index, window in enumerate(windows):
        nll += float(runtime.window_nll(window))
        if progress:
            progress(index + 1, len(windows))
    scored = len(windows) * (seqlen - 1)
    return math.exp(nll / scored), scored, time.perf_counter() - started
