"""The committed reference models: load offline, match their cards, route to every expert."""

import json
import os

import pytest

from hexq.data import eval_text, tokenize
from hexq.eval.perplexity import perplexity
from hexq.models import load_model
from tests.conftest import REFERENCE_MODELS

EXPECTED = {
    "mixtral": dict(model_type="mixtral", experts=8, top_k=2),
    "qwen3moe": dict(model_type="qwen3_moe", experts=32, top_k=4),
}


@pytest.fixture(scope="module", params=sorted(REFERENCE_MODELS))
def reference(request):
    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = REFERENCE_MODELS[request.param]
    model, tokenizer, adapter = load_model(folder)
    return request.param, folder, model, tokenizer, adapter, json.loads((folder / "card.json").read_text())


def test_architecture_and_size(reference):
    name, folder, model, _, adapter, card = reference
    expected = EXPECTED[name]
    assert model.config.model_type == expected["model_type"]
    assert getattr(model.config, adapter.num_experts_attr) == expected["experts"]
    assert model.config.num_experts_per_tok == expected["top_k"]
    assert model.config.hidden_size >= 192
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 20 * 1024 * 1024
    assert card["params_total"] == sum(p.numel() for p in model.parameters())


def test_card_perplexity_on_the_first_200_windows_reproduces(reference):
    _, _, model, tokenizer, _, card = reference
    recorded = card["rtn"]["fp"]["wikitext2"]
    result = perplexity(model, tokenize(tokenizer, eval_text("wikitext2")), card["seqlen"], 200, batch_size=8)
    assert result.windows == recorded["windows"] == 200
    assert result.perplexity == pytest.approx(recorded["perplexity"], rel=1e-3)


@pytest.mark.slow
def test_card_wikitext2_perplexity_reproduces_within_0_1_percent(reference):
    _, _, model, tokenizer, _, card = reference
    recorded = card["perplexity"]["wikitext2"]
    result = perplexity(model, tokenize(tokenizer, eval_text("wikitext2")), card["seqlen"], None, batch_size=8)
    assert result.windows == recorded["windows"]
    assert result.perplexity == pytest.approx(recorded["perplexity"], rel=1e-3)


def test_no_dead_experts_and_skewed_routing(reference):
    *_, card = reference
    for row in card["expert_load"]["per_layer"]:
        assert row["never_used"] == 0, row
        assert row["top25pct_experts_share"] > 0.25  # skewed: the hottest quarter takes more than its share


def test_low_bit_rtn_visibly_hurts(reference):
    *_, card = reference
    fp, rtn = card["rtn"]["fp"]["austen"]["perplexity"], card["rtn"]
    assert rtn["8"]["austen"]["perplexity"] == pytest.approx(fp, rel=0.01)
    assert rtn["3"]["austen"]["perplexity"] > fp * 1.02
    assert rtn["2"]["austen"]["perplexity"] > rtn["3"]["austen"]["perplexity"] > rtn["4"]["austen"]["perplexity"]
