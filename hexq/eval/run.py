"""Evaluate a model on several texts with the perplexity protocol: the library entry behind `hexq eval`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hexq.data import eval_text, tokenize
from hexq.eval.perplexity import PerplexityResult, perplexity
from hexq.models import load_model


@dataclass(frozen=True)
class EvalRow:
    data: str
    result: PerplexityResult

    def as_dict(self) -> dict:
        return {"data": self.data, **asdict(self.result)}


def evaluate_model(model_path: str | Path, data: list[str], seqlen: int, max_windows: int | None, batch_size: int,
                   device: str | None = None,
                   progress: Callable[[str, int, int], None] | None = None) -> list[EvalRow]:
    """Perplexity of the model folder on each data source (corpus name or file), same protocol for all."""
    model, tokenizer, _ = load_model(model_path, device)
    token_streams = {source: tokenize(tokenizer, eval_text(source)) for source in data}
    rows = []
    for source, ids in token_streams.items():
        report = None if progress is None else (lambda done, total, s=source: progress(s, done, total))
        rows.append(EvalRow(source, perplexity(model, ids, seqlen, max_windows, batch_size, report)))
    return rows
