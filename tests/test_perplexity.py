import math

import pytest
import torch

from hexq.base.errors import HexqError
from hexq.eval.perplexity import make_windows, perplexity
from tests.conftest import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen3_moe", seed=1)


def hand_perplexity(model, ids: torch.Tensor, seqlen: int) -> float:
    """The GPTQ protocol written out token by token: every window, every position, one log-prob at a time."""
    total, count = 0.0, 0
    for w in range(ids.numel() // seqlen):
        window = ids[w * seqlen : (w + 1) * seqlen]
        with torch.no_grad():
            logits = model(input_ids=window[None]).logits[0].double()
        for t in range(seqlen - 1):
            total -= float(torch.log_softmax(logits[t], dim=-1)[window[t + 1]])
            count += 1
    return math.exp(total / count)


def test_matches_hand_computation_and_drops_the_remainder(model):
    ids = torch.randint(0, 8192, (3 * 16 + 5,), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, ids, seqlen=16, batch_size=2)
    assert result.windows == 3 and result.tokens_scored == 3 * 15 and result.tokens_available == 53
    assert result.perplexity == pytest.approx(hand_perplexity(model, ids, 16), rel=1e-5)


def test_batch_size_and_window_cap(model):
    ids = torch.randint(0, 8192, (80,), generator=torch.Generator().manual_seed(1))
    full = perplexity(model, ids, seqlen=16, batch_size=5)
    assert perplexity(model, ids, seqlen=16, batch_size=1).perplexity == pytest.approx(full.perplexity, rel=1e-6)
    capped = perplexity(model, ids, seqlen=16, max_windows=2)
    assert capped.windows == 2
    assert capped.perplexity == pytest.approx(hand_perplexity(model, ids[:32], 16), rel=1e-5)


class UniformModel(torch.nn.Module):
    """Equal logits for every token: perplexity must equal the vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": 64})()

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab) + self.anchor
        return type("Output", (), {"logits": logits})()


def test_uniform_model_has_perplexity_equal_to_vocab():
    ids = torch.randint(0, 50, (64,))
    assert perplexity(UniformModel(50), ids, seqlen=8).perplexity == pytest.approx(50.0, rel=1e-6)


def test_bad_windows():
    model = UniformModel(10)
    with pytest.raises(HexqError, match="exceeds the model's context"):
        perplexity(model, torch.zeros(1000, dtype=torch.long), seqlen=65)
    with pytest.raises(HexqError, match="too short"):
        make_windows(torch.zeros(7, dtype=torch.long), seqlen=8)
