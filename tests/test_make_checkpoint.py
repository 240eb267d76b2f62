"""scripts/make_checkpoint.py: hub-layout random checkpoints load in transformers with every tensor in place."""

import copy
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hexq.base.errors import HexqError
from scripts.checkpoint_families import FAMILIES, build_config, families, weight_files
from scripts.checkpoint_skew import (
    calibrate_alpha,
    corpus_windows,
    hot_quarter_share,
    select_experts,
    shares_on_random_inputs,
    shares_on_text,
)
from scripts.make_checkpoint import checkpoint_plan, parse_size, plan_shards, write_checkpoint

SHARE_BAND_TEXT = (0.30, 0.45)  # forward pass over corpus text, mean over MoE layers, tiny, --skew 0.35
SHARE_TOLERANCE_RANDOM = 0.03  # normalized random router inputs: calibrated target +- this


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, shard in weight_files(folder).items():
        with safe_open(folder / shard, "pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


def fuse(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """The hub's per-expert keys as transformers 5.x holds them: experts stacked, gate_up_proj[e] = cat(gate, up)."""
    hub_names = ("w1", "w3", "w2") if model_type in ("mixtral", "phimoe") else ("gate_proj", "up_proj", "down_proj")
    gate, up, down = hub_names
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    fused = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", name)
        if match:
            experts[match[1]][int(match[2])][match[3]] = tensor
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if model_type == "phimoe":
            name = name.replace(".mlp.gate.weight", ".mlp.router.weight")
        fused[name] = tensor
    for layer, per_expert in experts.items():
        order = sorted(per_expert)
        assert order == list(range(len(order))), f"{layer}: experts {order}"
        fused[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e][gate], per_expert[e][up]]) for e in order])
        fused[f"{layer}.mlp.experts.down_proj"] = torch.stack([per_expert[e][down] for e in order])
    return fused


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models run faster on one thread than on a pool shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, single_thread):
    """family -> (folder, loaded model, loading info): one tiny checkpoint of every family."""
    from transformers import AutoModelForCausalLM

    out = {}
    for family in families():
        folder = write_checkpoint(tmp_path_factory.mktemp(family) / "ckpt", family)
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        out[family] = (folder, model.eval(), info)
    return out


@pytest.mark.parametrize("family", families())
def test_tiny_checkpoint_loads_with_no_missing_or_unexpected_keys_and_equal_tensors(tiny, family):
    folder, model, info = tiny[family]
    assert model.config.model_type == family
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert not info["error_msgs"], info["error_msgs"]
    expected = fuse(read_tensors(folder), family)
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, value in state.items():
        assert value.shape == expected[name].shape, name
        assert torch.equal(value, expected[name].to(value.dtype)), name


@pytest.mark.parametrize("family", families())
def test_tiny_keeps_the_family_structure(tiny, family):
    folder, model, _ = tiny[family]
    config = json.loads((folder / "config.json").read_text())
    names = set(weight_files(folder))
    assert config["vocab_size"] == 8192 and config["hidden_size"] == 64
    assert 8 <= len(model.model.layers[-1].mlp.experts.gate_up_proj) <= 16
    if family in ("deepseek_v2", "deepseek_v3"):
        assert config["first_k_dense_replace"] == 1 and "model.layers.0.mlp.gate_proj.weight" in names
        assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names
    if family == "deepseek_v3":
        assert config["n_group"] > 1 and config["topk_group"] < config["n_group"]
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
        assert "model.layers.1.self_attn.q_a_proj.weight" in names
    if family == "deepseek_v2":
        assert "model.layers.1.self_attn.q_proj.weight" in names  # V2-Lite: no query LoRA
    if family == "qwen2_moe":
        assert {"model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.q_proj.bias"} <= names
    if family == "phimoe":
        assert {"model.layers.0.input_layernorm.bias", "lm_head.bias", "model.layers.0.self_attn.o_proj.bias"} <= names
        assert len(config["rope_scaling"]["long_factor"]) == 64 // 4 // 2


def published_meta_model(family: str, layers: int, tmp_path: Path):
    """The published-shape model on the meta device, from the config.json the script writes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(build_config(family, "published", layers)))
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", families())
def test_published_shapes_are_transformers_shapes(tmp_path, family):
    layers = 2  # DeepSeek: one dense and one MoE layer
    config, model = published_meta_model(family, layers, tmp_path)
    published = FAMILIES[family].published
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_experts_per_tok", "intermediate_size"):
        assert getattr(config, key) == published[key], key
    plans = checkpoint_plan(build_config(family, "published", layers))
    expected = fuse({p.name: torch.empty(p.shape, dtype=p.dtype, device="meta") for p in plans}, family)
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, value in state.items():
        assert tuple(value.shape) == tuple(expected[name].shape), name


def test_published_config_changes_only_the_documented_values():
    documented = {"num_hidden_layers", "bos_token_id", "eos_token_id", "pad_token_id", "architectures",
                  "num_nextn_predict_layers", "first_k_dense_replace"}
    for family in families():
        published, written = FAMILIES[family].published, build_config(family, "published", 4)
        changed = {k for k in published if published[k] != written.get(k)}
        assert changed <= documented, (family, changed - documented)
        assert written["num_hidden_layers"] == 4 and "auto_map" not in written
    assert build_config("deepseek_v3", "published", 4)["first_k_dense_replace"] == 3
    assert build_config("deepseek_v3", "published", 2)["first_k_dense_replace"] == 1
    assert build_config("qwen3_moe", "published", 1)["moe_intermediate_size"] == 768


def test_index_lists_every_tensor_and_every_shard_exists(tmp_path):
    folder = write_checkpoint(tmp_path / "c", "qwen2_moe", shard_size="200KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    in_files, total = {}, 0
    for shard in shards:
        with safe_open(folder / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                in_files[name] = shard
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    assert index["weight_map"] == in_files
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    plans = checkpoint_plan(json.loads((folder / "config.json").read_text()))
    assert set(in_files) == {p.name for p in plans}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= {
        p.name for p in folder.iterdir()}


def test_one_shard_is_a_single_model_safetensors_without_index(tmp_path):
    folder = write_checkpoint(tmp_path / "c", "mixtral", shard_size="1GB")
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]


def test_same_seed_same_bytes_whatever_the_sharding_and_other_seed_differs(tmp_path):
    a = write_checkpoint(tmp_path / "a", "deepseek_v3", seed=3)
    b = write_checkpoint(tmp_path / "b", "deepseek_v3", seed=3)
    c = write_checkpoint(tmp_path / "c", "deepseek_v3", seed=3, shard_size="1GB")
    d = write_checkpoint(tmp_path / "d", "deepseek_v3", seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ta, tc, td = read_tensors(a), read_tensors(c), read_tensors(d)
    assert set(ta) == set(tc) and all(torch.equal(ta[k], tc[k]) for k in ta)
    assert not torch.equal(ta["model.layers.1.mlp.experts.0.up_proj.weight"],
                           td["model.layers.1.mlp.experts.0.up_proj.weight"])


@pytest.mark.parametrize("family", families())
def test_router_skew_is_in_its_band_on_text_and_on_random_inputs(tiny, family):
    folder, model, _ = tiny[family]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, model_max_length=1 << 30)
    text = shares_on_text(model, corpus_windows(tokenizer))
    mean = sum(text) / len(text)
    assert SHARE_BAND_TEXT[0] <= mean <= SHARE_BAND_TEXT[1], (family, text)
    random = shares_on_random_inputs(folder, samples=8192)
    assert abs(sum(random) / len(random) - 0.35) <= SHARE_TOLERANCE_RANDOM, (family, random)


def test_unskewed_routers_are_balanced_on_random_inputs(tmp_path):
    folder = write_checkpoint(tmp_path / "c", "olmoe", skew=0.25)
    shares = shares_on_random_inputs(folder)
    assert all(0.25 <= s <= 0.28 for s in shares), shares  # the most-used quarter of a sample: a little over 1/4


@pytest.mark.parametrize("family", families())
def test_expert_selection_matches_the_transformers_router(tiny, family):
    _, model, _ = tiny[family]
    config = model.config.to_dict()
    layer = model.model.layers[-1].mlp
    router = copy.deepcopy(layer.router if family == "phimoe" else layer.gate).float()
    x = torch.randn(512, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _, indices = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    ours = select_experts(config, logits, bias)
    assert torch.equal(ours.sort(dim=-1).values, indices.sort(dim=-1).values)


def test_hot_quarter_share_counts_the_most_used_quarter():
    indices = torch.tensor([[0, 1], [0, 2], [0, 3], [4, 5]])  # expert 0: 3 of 8 slots; 8 experts -> quarter = 2
    assert hot_quarter_share(indices, 8) == pytest.approx(4 / 8)


def test_calibration_reaches_the_target_and_rejects_impossible_ones():
    config = build_config("mixtral", "tiny")
    assert calibrate_alpha(config, 0.25) == 0.0
    assert 0 < calibrate_alpha(config, 0.35) < calibrate_alpha(config, 0.45)
    with pytest.raises(HexqError, match="--skew 0.2"):
        calibrate_alpha(config, 0.2)


def test_shards_fill_in_order_and_sizes_parse():
    plans = checkpoint_plan(build_config("mixtral", "tiny"))
    shards = plan_shards(plans, 300_000)
    assert [p for shard in shards for p in shard] == plans
    assert all(sum(p.nbytes for p in shard) <= 300_000 or len(shard) == 1 for shard in shards)
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5MiB") == 3 * 2**19 and parse_size("100") == 100
    with pytest.raises(HexqError, match="2 gigs"):
        parse_size("2 gigs")


def test_user_errors_name_what_to_change(tmp_path):
    with pytest.raises(HexqError, match="unknown family 'gpt'"):
        build_config("gpt")
    with pytest.raises(HexqError, match="unknown config key 'num_expert'"):
        build_config("olmoe", num_expert=4)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(HexqError, match="not empty"):
        write_checkpoint(tmp_path / "c", "olmoe")


def test_overrides_change_the_shapes(tmp_path):
    folder = write_checkpoint(tmp_path / "c", "olmoe", layers=1, num_experts=8, num_experts_per_tok=2)
    names = set(weight_files(folder))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.experts.8.down_proj.weight" not in names
    assert "model.layers.1.input_layernorm.weight" not in names
