"""KL divergence against a reference model (hexq eval --kl-against): the per-token math, the blocked head, and the
streamed evaluation of two models over the same windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import REFERENCE_MODELS, save_tiny_model

from hexq.base.errors import HexqError
from hexq.eval import divergence as kl
from hexq.eval.run import evaluate_model

EVAL = dict(data=["austen", "pydocs"], seqlen=64, max_windows=3, batch_size=2, device="cpu")


def test_token_divergence_is_the_kl_of_the_softmaxes():
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(7, 50, generator=generator) * 3
    logits = reference + torch.randn(7, 50, generator=generator) * 0.5
    targets = torch.randint(0, 50, (7,), generator=generator)
    got = kl.token_divergence(logits, reference, targets)
    want = F.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(reference, -1), log_target=True,
                    reduction="none").sum(-1)
    torch.testing.assert_close(got.kld, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.agree, logits.argmax(-1) == reference.argmax(-1))
    torch.testing.assert_close(got.nll, F.cross_entropy(logits, targets, reduction="none"))
    torch.testing.assert_close(got.reference_nll, F.cross_entropy(reference, targets, reduction="none"))
    same = kl.token_divergence(reference, reference, targets)
    assert float(same.kld.abs().max()) < 1e-6 and bool(same.agree.all())


def test_the_head_in_vocabulary_blocks_equals_one_product():
    generator = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(5, 16, generator=generator), torch.randn(70, 16, generator=generator), \
        torch.randn(70, generator=generator)
    torch.testing.assert_close(kl.head_logits(x, weight.bfloat16(), bias, torch.float32, vocab_rows=32),
                               F.linear(x, weight.bfloat16().float(), bias))


def test_summary_percentiles_and_agreement():
    kld = torch.arange(1, 101, dtype=torch.float32) / 100
    nll = torch.full((100,), 2.0)
    summary = kl.Divergence(kld, torch.arange(100) % 4 != 0, nll, nll - 0.1).summary()
    assert summary["kld_mean"] == pytest.approx(0.505) and summary["kld_max"] == pytest.approx(1.0)
    assert summary["kld_p90"] == pytest.approx(0.901, abs=1e-6) and summary["kld_p99"] == pytest.approx(0.9901)
    assert summary["top1_agreement"] == 0.75 and summary["perplexity_ratio"] == pytest.approx(torch.e ** 0.1)


@pytest.fixture(scope="module")
def reference_artifact(tmp_path_factory):
    from conftest import small_recipe

    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import Budget, pack

    folder = tmp_path_factory.mktemp("kl")
    calibrate(REFERENCE_MODELS["qwen3moe"], small_recipe("experts-mixed"), "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", budget=Budget(avg_bits=2.0))
    return folder / "model.hexq"


def test_kl_against_the_original(reference_artifact, monkeypatch):
    model = REFERENCE_MODELS["qwen3moe"]
    plain = {row.data: row.result.perplexity for row in evaluate_model(reference_artifact, **EVAL)}
    original = {row.data: row.result.perplexity for row in evaluate_model(model, **EVAL)}
    rows = evaluate_model(reference_artifact, **EVAL, kl_against=model)
    for row in rows:
        got = row.divergence
        # the perplexity from the divergence pass is the plain protocol's; the reference's is the original's
        assert row.result.perplexity == pytest.approx(plain[row.data], rel=1e-5)
        assert got["reference_perplexity"] == pytest.approx(original[row.data], rel=1e-5)
        assert got["perplexity_ratio"] == pytest.approx(plain[row.data] / original[row.data], rel=1e-5)
        assert 0 < got["kld_mean"] < got["kld_p99"] <= got["kld_max"] and 0.5 < got["top1_agreement"] < 1
        assert got["tokens"] == 3 * 63
    monkeypatch.setattr(kl, "LOGIT_FLOATS", 8192 * 5)  # 5 positions per chunk: the same numbers
    again = evaluate_model(reference_artifact, **EVAL, kl_against=model)
    for row, other in zip(rows, again, strict=True):
        assert other.divergence == pytest.approx(row.divergence, rel=1e-4)  # float32 sums in other blocks
    (self_row, *_) = evaluate_model(model, **EVAL, kl_against=model)
    assert self_row.divergence["kld_max"] < 1e-6 and self_row.divergence["top1_agreement"] == 1.0


def test_kl_needs_one_vocabulary(tmp_path, tiny_qwen3moe):
    other = save_tiny_model(tmp_path / "other", "qwen3_moe", vocab_size=8200)
    with pytest.raises(HexqError, match="vocabulary"):
        evaluate_model(tiny_qwen3moe, **EVAL, kl_against=other)


def test_the_served_model_against_the_original(reference_artifact):
    """hexq run --ppl --kl-against: the runtime's windows (one forward pass each) against the streamed original give
    the runtime's own perplexity and, in fp32, the simulated model's divergence."""
    from hexq.base.data import eval_text, tokenize
    from hexq.eval.run import runtime_divergence, runtime_perplexity
    from hexq.runtime.engine import Runtime

    model = REFERENCE_MODELS["qwen3moe"]
    (simulated,) = evaluate_model(reference_artifact, ["austen"], 64, 3, 2, "cpu", kl_against=model)
    with Runtime(reference_artifact, dtype="fp32") as runtime:
        text = eval_text("austen")
        ids = tokenize(runtime.tokenizer, text)
        got = runtime_divergence(runtime, text, ids, 64, 3, model).summary()
        served, _, _ = runtime_perplexity(runtime, ids, 64, 3)
    assert got["perplexity"] == pytest.approx(served, rel=1e-4)
    assert got["reference_perplexity"] == pytest.approx(simulated.divergence["reference_perplexity"], rel=1e-5)
    assert got["kld_mean"] == pytest.approx(simulated.divergence["kld_mean"], rel=0.05)
    assert got["tokens"] == 3 * 63
