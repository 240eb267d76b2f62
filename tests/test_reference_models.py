"""The committed reference models: load offline, are what their cards say, route to every expert, and low-bit RTN
visibly hurts them. Every number asserted here is measured on the loaded model; the card is only compared with it."""

import copy
import json
import os

import pytest
import torch

from hexq.algos.quant import QuantSpec
from hexq.base.data import TRAIN_CORPORA, eval_text, tokenize
from hexq.eval.perplexity import make_windows, perplexity
from tests.conftest import REFERENCE_MODELS

from reference import capture_router_counts, load_model
from rtn import rtn_quantize_model

EXPECTED = {
    "mixtral": dict(model_type="mixtral", experts=8, top_k=2),
    "qwen3moe": dict(model_type="qwen3_moe", experts=32, top_k=4),
}
SEQLEN = 256
ROUTING_WINDOWS = 8  # per held-out text: 3 x 2048 tokens, >100 routed slots for the coldest expert of either model
RTN_WINDOWS = 10  # of austen's held-out text


@pytest.fixture(scope="module", params=sorted(REFERENCE_MODELS))
def reference(request):
    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = REFERENCE_MODELS[request.param]
    model, tokenizer, adapter = load_model(folder)
    return request.param, folder, model, tokenizer, adapter, json.loads((folder / "card.json").read_text())


def expert_parameters(model, adapter) -> int:
    return sum(getattr(getattr(layer, adapter.moe), adapter.experts).gate_up_proj.numel()
               + getattr(getattr(layer, adapter.moe), adapter.experts).down_proj.numel()
               for layer in model.model.layers)


def test_architecture_and_size(reference):
    name, folder, model, _, adapter, card = reference
    config, expected = model.config, EXPECTED[name]
    experts = getattr(config, adapter.num_experts_attr)
    assert (config.model_type, experts, config.num_experts_per_tok) == (expected["model_type"], expected["experts"],
                                                                       expected["top_k"])
    assert config.hidden_size >= 192
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 20 * 1024 * 1024
    # the card describes this model: its architecture and its parameter counts, counted here
    measured = {"model_type": config.model_type, "architecture": type(model).__name__,
                "layers": len(model.model.layers), "hidden": config.hidden_size,
                "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads, "experts": experts,
                "top_k": config.num_experts_per_tok, "vocab": model.get_input_embeddings().num_embeddings}
    assert {key: card[key] for key in measured} == measured
    total, routed = sum(p.numel() for p in model.parameters()), expert_parameters(model, adapter)
    assert card["params_total"] == total
    assert card["params_active"] == total - routed + routed * config.num_experts_per_tok // experts


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
    """Routed on held-out text of every training domain: each layer uses every expert, and unevenly."""
    _, _, model, tokenizer, adapter, _ = reference
    experts = getattr(model.config, adapter.num_experts_attr)
    with torch.no_grad(), capture_router_counts(model, adapter, experts) as stats:
        for text in TRAIN_CORPORA:
            for batch in make_windows(tokenize(tokenizer, eval_text(text)), SEQLEN, ROUTING_WINDOWS).split(8):
                model(input_ids=batch, use_cache=False)
    slots = 3 * ROUTING_WINDOWS * SEQLEN * model.config.num_experts_per_tok
    assert stats.counts.sum(dim=1).tolist() == [slots] * len(model.model.layers)  # every token routed top_k times
    assert (stats.counts > 0).all(), stats.counts
    top_quarter = stats.load.topk(max(1, experts // 4), dim=1).values.sum(dim=1)
    assert (top_quarter > 0.25).all(), top_quarter  # skewed: the hottest quarter takes more than its share


def test_low_bit_rtn_visibly_hurts(reference):
    """RTN (symmetric, per output channel) of the attention and expert weights, measured on held-out austen."""
    _, _, model, tokenizer, adapter, _ = reference
    ids = tokenize(tokenizer, eval_text("austen"))
    ppl = {"fp": perplexity(model, ids, SEQLEN, RTN_WINDOWS, batch_size=8).perplexity}
    for bits in (8, 4, 3, 2):
        quantized = copy.deepcopy(model)
        rtn_quantize_model(quantized, adapter, QuantSpec(bits=bits, group_size=None, symmetric=True))
        ppl[bits] = perplexity(quantized, ids, SEQLEN, RTN_WINDOWS, batch_size=8).perplexity
    # measured on 10 windows: mixtral fp 57.5, 8 bits 57.6, 4 bits 58.2, 3 bits 59.3, 2 bits 71.0 (qwen3moe alike)
    assert ppl[8] == pytest.approx(ppl["fp"], rel=0.01)
    assert ppl[3] > ppl["fp"] * 1.02
    assert ppl[2] > ppl[3] > ppl[4] > ppl["fp"]
