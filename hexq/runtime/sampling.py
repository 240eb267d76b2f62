"""How the next token is chosen from a step's logits, and how generated tokens become streamed text.

One place for both, shared by `hexq run` and `hexq serve`, so a request to the server with the same seed and
settings gives the same continuation as `hexq run`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax, ties to the lowest id). Otherwise the softmax of logits / temperature, cut to
    the top_k most likely tokens (0: no cut) and to the smallest set whose probability reaches top_p (1: no cut),
    sampled with a generator seeded by `seed` at the start of the sequence."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature {self.temperature}: give 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: give a value in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k}: give 0 (no cut) or more")

    def generator(self) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(self.seed)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The token chosen from float logits [vocab] (see Sampling)."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, -1)
    if sampling.top_k or sampling.top_p < 1:
        probs = _nucleus(probs, sampling.top_k, sampling.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _nucleus(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """probs with every token outside the top_k and outside the smallest top-p set zeroed (renormalised by
    multinomial). Sorted descending, a token is kept while the mass before it is below top_p: the most likely
    token always stays."""
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_probs = probs[order]
    keep = (torch.cumsum(sorted_probs, 0) - sorted_probs) < top_p
    if top_k:
        keep[top_k:] = False
    kept = torch.zeros_like(probs)
    kept[order[keep]] = sorted_probs[keep]
    return kept


class TextStream:
    """Generated tokens as text pieces safe to send: a piece never ends inside a multi-byte character (the decoder
    shows an unfinished one as U+FFFD) and never shows the start of a stop string that may still complete; once a
    stop string appears the text ends before it (`stopped`). Special tokens (the end of sequence) are not text.
    Pieces concatenated equal `text`."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # what has been sent
        self.stopped = False

    def push(self, token: int) -> str:
        """The new piece of text that `token` makes safe to send ("" when it must wait)."""
        self.tokens.append(token)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [at for stop in self.stop if (at := full.find(stop)) >= 0]
        if hits:
            full, self.stopped = full[:min(hits)], True
        else:
            full = full[:len(full) - _held_back(full, self.stop)]
        return self._send(full)

    def finish(self) -> str:
        """The rest once generation ends (a held-back prefix of a stop string that never completed)."""
        if self.stopped:
            return ""
        return self._send(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def _send(self, full: str) -> str:
        """What `full` adds to the text sent so far."""
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        return piece


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Characters at the end of `text` that cannot be sent yet: an unfinished character, or the longest suffix that
    is a proper prefix of a stop string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
