"""Evaluate a model on several texts with the perplexity protocol: the library entry behind `hexq eval`.

Every target is evaluated streamed (hexq.model.layer_pass.stream_nll): one decoder layer in memory at a time, every
window through layer l before layer l+1 is read, so a model bigger than memory can be measured. The windows of all texts
go through the layers together, so the model is read once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hexq.base.data import eval_text, tokenize
from hexq.base.devices import resolve_device
from hexq.base.errors import HexqError
from hexq.calib.calibrated import calibrated_model
from hexq.eval.divergence import Divergence, divergence, streamed_head
from hexq.eval.perplexity import PerplexityResult, make_windows
from hexq.model.folder import context_length
from hexq.model.layer_pass import full_precision_plan, stream_layers, stream_nll
from hexq.model.streaming import open_model
from hexq.runtime.compute import SCORING_DTYPE, weight_rows
from hexq.runtime.model import artifact_model


@dataclass(frozen=True)
class EvalRow:
    data: str
    result: PerplexityResult
    divergence: dict | None = None  # against --kl-against's model (hexq.eval.divergence.Divergence.summary)

    def as_dict(self) -> dict:
        return {"data": self.data, **asdict(self.result)} | ({"kl": self.divergence} if self.divergence else {})


def is_artifact(path: Path) -> bool:
    manifest = path / "manifest.json"
    return manifest.is_file() and b'"hexq-artifact"' in manifest.read_bytes()


def open_target(path: Path, device: torch.device, expert_bits: int | None):
    """(streamed model, tokenizer, prepare) for a HuggingFace model folder, a hexq calibration folder or a packed
    artifact (its static allocation)."""
    if is_artifact(path):
        if expert_bits is not None:
            raise HexqError("--expert-bits applies to a calibration folder; an artifact runs at its allocation")
        return artifact_model(path, device)
    if (path / "manifest.json").exists():
        return calibrated_model(path, device, expert_bits)
    if expert_bits is not None:
        raise HexqError("--expert-bits applies to a calibration folder, not to a model folder")

    streamed, tokenizer = open_model(path, device)
    return streamed, tokenizer, full_precision_plan(streamed)


def check_window_length(seqlen: int, context: int) -> None:
    """The one check of a window length against the model's context (hexq eval and hexq run --ppl)."""
    if context and seqlen > context:
        raise HexqError(f"window length {seqlen} exceeds the model's context of {context} tokens")


def evaluate_model(model_path: str | Path, data: list[str], seqlen: int, max_windows: int | None, batch_size: int,
                   device: str | torch.device | None = None,
                   progress: Callable[[str, int, int], None] | None = None,
                   expert_bits: int | None = None, activation_limit: int | None = None,
                   kl_against: str | Path | None = None) -> list[EvalRow]:
    """Perplexity of a model folder, a calibration folder's quantized model, or an artifact, on each data source
    (corpus name or file), same protocol for all; with `kl_against` (a model folder, calibration or artifact), also
    the KL divergence of its next-token distributions from that model's on the same windows
    (hexq.eval.divergence)."""
    device = device if isinstance(device, torch.device) else resolve_device(device)
    streamed, tokenizer, prepare = open_target(Path(model_path), device, expert_bits)
    texts = {source: eval_text(source) for source in data}
    streams = {source: tokenize(tokenizer, text) for source, text in texts.items()}
    check_window_length(seqlen, context_length(streamed.config))
    windows = {source: make_windows(ids, seqlen, max_windows) for source, ids in streams.items()}
    ids = torch.cat(list(windows.values()))
    if kl_against is None:
        nll = stream_nll(streamed, ids, batch_size, prepare, activation_limit, progress=progress)
        divergences = None
    else:
        reference = open_reference(Path(kl_against), device, texts, streams, streamed.config.vocab_size)
        divergences = kl_divergence(streamed, prepare, reference, ids, batch_size, activation_limit, progress)
        nll = divergences.nll.double().reshape(ids.shape[0], -1).sum(1)
    rows, start = [], 0
    for source, cut in windows.items():
        total = float(nll[start:start + cut.shape[0]].sum())
        scored = cut.shape[0] * (seqlen - 1)
        summary = None
        if divergences is not None:
            summary = divergences[start * (seqlen - 1):start * (seqlen - 1) + scored].summary()
        start += cut.shape[0]
        mean = total / scored
        rows.append(EvalRow(source, PerplexityResult(math.exp(mean), mean, seqlen, cut.shape[0], scored,
                                                     int(streams[source].numel())), summary))
    return rows


def open_reference(path: Path, device: torch.device, texts: dict[str, str], streams: dict[str, torch.Tensor],
                   vocab_size: int):
    """(streamed model, layer plan) of the model the KL divergence is measured against, checked to share the
    evaluated model's vocabulary and to tokenize each text (name: text) into the same ids (name: ids)."""
    reference, reference_tokenizer, prepare = open_target(path, device, None)
    for source, text in texts.items():
        if not torch.equal(tokenize(reference_tokenizer, text), streams[source]):
            raise HexqError(f"{path} tokenizes {source} differently: the KL divergence compares distributions over "
                            "one vocabulary")
    if reference.config.vocab_size != vocab_size:
        raise HexqError(f"{path} has a vocabulary of {reference.config.vocab_size}, the evaluated model "
                        f"{vocab_size}")
    return reference, prepare


def kl_divergence(streamed, prepare, reference, ids: torch.Tensor, batch_size: int, activation_limit: int | None,
                  progress) -> Divergence:
    """Per-token divergence of the streamed model from `reference` (open_reference's pair) on windows `ids`: both
    models streamed layer by layer over the same windows (one model's layer in memory at a time), then both
    heads."""
    reference, reference_prepare = reference
    hidden = stream_layers(streamed, ids, batch_size, prepare, activation_limit, progress=progress)
    try:
        reference_hidden = stream_layers(reference, ids, batch_size, reference_prepare, activation_limit,
                                         progress=progress)
        try:
            with streamed_head(streamed) as head, streamed_head(reference) as reference_head:
                return divergence(hidden, head, reference_hidden, reference_head, ids, batch_size)
        finally:
            reference_hidden.close()
    finally:
        hidden.close()


def runtime_divergence(runtime, text: str, ids: torch.Tensor, seqlen: int, max_windows: int | None,
                       reference_path: Path, progress: Callable[[int, int], None] | None = None) -> Divergence:
    """Per-token divergence of the runtime's next-token distributions (one window per forward pass, as
    runtime_perplexity scores them) from the model at `reference_path` (streamed layer by layer) on the same
    windows of `text` (hexq.eval.divergence)."""
    check_window_length(seqlen, runtime.plan.context)
    windows = make_windows(ids, seqlen, max_windows)
    reference, prepare = open_reference(Path(reference_path), runtime.device, {"the text": text}, {"the text": ids},
                                        runtime.model.config.vocab_size)
    states = []
    for index, window in enumerate(windows):
        states.append(runtime.window_states(window)[None])
        if progress:
            progress(index + 1, len(windows))
    reference_hidden = stream_layers(reference, windows, 1, prepare)
    head = runtime.model.lm_head
    try:
        with streamed_head(reference) as reference_head:
            ours = (torch.nn.Identity(), weight_rows(head), getattr(head, "bias", None), SCORING_DTYPE)
            return divergence(states, ours, reference_hidden, reference_head, windows, 1)
    finally:
        reference_hidden.close()


def decoded_window_nll(runtime, window: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of one window scored through the native decode step: the first token prefilled by the
    transformers path, every later one a decode step, so that what is scored is the arithmetic `hexq run` generates
    with (the step's re-laid codes and activation blocks: kernels.c "int8 activation blocks")."""
    logits, past = runtime._next_logits(window[None, :1], None)
    runtime.native.start(past, 1, len(window))
    nll = torch.zeros((), dtype=torch.float64)
    for position in range(1, len(window)):
        if position > 1:
            logits = runtime.native.step(int(window[position - 1]))
        nll -= torch.log_softmax(logits.double(), dim=-1)[int(window[position])]
    return nll


def runtime_perplexity(runtime, ids: torch.Tensor, seqlen: int, max_windows: int | None,
                       progress: Callable[[int, int], None] | None = None,
                       decoded: bool = False) -> tuple[float, int, float]:
    """(perplexity, tokens scored, seconds) of a hexq.runtime.engine.Runtime with the GPTQ protocol (the windows of
    `make_windows`), one window per forward pass so that the precision policy sees each as a sequence; `decoded`:
    every position after a window's first through the native decode step (decoded_window_nll)."""
    check_window_length(seqlen, runtime.plan.context)
    if decoded and runtime.native is None:
        raise HexqError(f"the native decode step does not serve this run ({runtime.decode_path})")
    windows = make_windows(ids, seqlen, max_windows)
    nll, started = 0.0, time.perf_counter()
    for index, window in enumerate(windows):
        nll += float(decoded_window_nll(runtime, window) if decoded else runtime.window_nll(window))
        if progress:
            progress(index + 1, len(windows))
    scored = len(windows) * (seqlen - 1)
    return math.exp(nll / scored), scored, time.perf_counter() - started
