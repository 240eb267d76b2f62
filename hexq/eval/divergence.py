"""KL divergence of a quantized model's next-token distributions from its original's, on the perplexity protocol's
windows: the field's yardstick for a quantized model (llama.cpp's `llama-perplexity --kl-divergence`), with far less
sampling noise than perplexity on the same tokens, since it compares whole distributions at every position instead
of one token's probability.

Per scored position t (the seqlen - 1 positions of each window that predict a token): P = softmax of the reference's
logits, Q = the evaluated model's, KLD_t = sum_v P_v (log P_v - log Q_v) (nats), top-1 agreement = [argmax P ==
argmax Q]. Reported per text: mean KLD, its 90th and 99th percentiles and maximum over positions, the top-1
agreement rate, and both perplexities with their ratio.

Logits are computed for a chunk of positions at a time, the head upcast a block of vocabulary rows at a time, so
neither a float32 head nor [positions, vocab] logits for a whole window exist at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

# float32 logits of one chunk of positions, for each of the two models: positions = LOGIT_FLOATS // vocab
LOGIT_FLOATS = 2**24  # 64 MiB per model
VOCAB_ROWS = 32768


@dataclass(frozen=True)
class Divergence:
    """Per-token figures of one text against the reference: kld, top-1 agreement, both models' NLL [tokens]."""

    kld: torch.Tensor
    agree: torch.Tensor
    nll: torch.Tensor
    reference_nll: torch.Tensor

    @staticmethod
    def join(parts: list[Divergence]) -> Divergence:
        return Divergence(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Divergence)))

    def __getitem__(self, tokens: slice) -> Divergence:
        return Divergence(*(getattr(self, f.name)[tokens] for f in fields(Divergence)))

    def summary(self) -> dict:
        kld = self.kld.double()
        ppl, reference = math.exp(float(self.nll.double().mean())), math.exp(float(self.reference_nll.double().mean()))
        return {"kld_mean": float(kld.mean()), "kld_p90": float(torch.quantile(kld, 0.90)),
                "kld_p99": float(torch.quantile(kld, 0.99)), "kld_max": float(kld.max()),
                "top1_agreement": float(self.agree.double().mean()), "perplexity": ppl,
                "reference_perplexity": reference, "perplexity_ratio": ppl / reference, "tokens": int(kld.numel())}


def head_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                vocab_rows: int = VOCAB_ROWS) -> torch.Tensor:
    """float32 logits [positions, vocab] of x W^T (+ b), W upcast to `dtype` a block of rows at a time."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    x = x.to(dtype)
    for start in range(0, weight.shape[0], vocab_rows):
        block = weight[start:start + vocab_rows].to(dtype)
        part = F.linear(x, block, None if bias is None else bias[start:start + vocab_rows].to(dtype))
        out[:, start:start + block.shape[0]] = part.float()
    return out


def token_divergence(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> Divergence:
    """The figures of Divergence for float32 logits [positions, vocab] against the reference's at `targets`."""
    log_q = torch.log_softmax(logits, -1)
    log_p = torch.log_softmax(reference, -1)
    kld = (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0)  # >= 0 exactly; rounding can leave -1e-9
    agree = logits.argmax(-1) == reference.argmax(-1)
    pick = targets[:, None]
    return Divergence(kld.cpu(), agree.cpu(), -log_q.gather(1, pick)[:, 0].cpu(), -log_p.gather(1, pick)[:, 0].cpu())


@contextmanager
def streamed_head(streamed) -> Iterator[tuple]:
    """(norm, head weight, head bias, compute dtype) of a hexq.model.streaming.StreamedModel, materialized for the block
    (the head in its stored dtype)."""
    with streamed.parts("model.norm"), streamed.parts("lm_head", dtype=streamed.head_dtype()):
        yield (streamed.model.model.norm, streamed.model.lm_head.weight, getattr(streamed.model.lm_head, "bias", None),
               streamed.dtype)


@torch.no_grad()
def divergence(hidden, head, reference_hidden, reference_head, ids: torch.Tensor, batch_size: int) -> Divergence:
    """Divergence over windows `ids` [N, L] from both models' last-layer outputs (HiddenStores, one entry per batch
    of `batch_size` windows) and heads (streamed_head's tuples)."""
    norm, weight, bias, dtype = head
    ref_norm, ref_weight, ref_bias, ref_dtype = reference_head
    positions = max(1, LOGIT_FLOATS // weight.shape[0])
    parts = []
    for index, batch in enumerate(ids.split(batch_size)):
        states = norm(hidden[index].to(weight.device))[:, :-1].reshape(-1, weight.shape[1])
        ref_states = ref_norm(reference_hidden[index].to(ref_weight.device))[:, :-1].reshape(-1, ref_weight.shape[1])
        targets = batch[:, 1:].reshape(-1).to(weight.device)
        for start in range(0, targets.shape[0], positions):
            stop = start + positions
            parts.append(token_divergence(head_logits(states[start:stop], weight, bias, dtype),
                                          head_logits(ref_states[start:stop], ref_weight, ref_bias, ref_dtype).to(
                                              weight.device), targets[start:stop]))
    return Divergence.join(parts)
