"""Every supported MoE family end to end, as the hub ships it: a random-weight checkpoint with the family's quirks
(scripts/make_checkpoint.py: per-expert hub keys, DeepSeek's dense first layers, MLA, shared experts, DeepSeek-V3's
router bias and group-limited top-k, Qwen2-MoE's shared_expert_gate, PhiMoE's sparsemixer and LayerNorm with bias,
Qwen3-MoE with a dense layer between MoE layers) goes calibrate (HAQ W8A8, 8-bit experts) -> pack -> run -> export
-> reload in transformers, and the 8-bit model must stay close to full precision.

Tolerances (every family; held-out austen, 8 windows x 128 tokens; the random checkpoints' perplexity is ~1.3e4
against a vocabulary of 8192, so only relative changes mean anything):
- perplexity of the served artifact within 0.5% of full precision (measured -0.05% to +0.27%, DeepSeek-V3 highest);
- logits: relative L2 against full precision <= 0.1 (measured 0.005-0.012, PhiMoE 0.059 and DeepSeek-V3 0.041).
  Plain round-to-nearest 8-bit weights in transformers itself give PhiMoE 0.046 and DeepSeek-V3 0.035: their routing
  weights are large (sparsemixer's are close to 1, V3's sum to routed_scaling_factor 2.5), so a top-k choice that
  flips on a near tie moves a token's output by a whole expert. A mis-wired part is far above the limit: serving
  kv_a_layernorm without its smoothing factors (kv_b_proj's codes carry them) gives 0.33-0.35.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from hexq.artifact.format import dense_shard
from hexq.artifact.reader import Artifact
from hexq.base.data import eval_text, tokenize
from hexq.calib.pipeline import calibrate
from hexq.calib.store import read_json
from hexq.config.recipe import Calibration
from hexq.config.recipe_files import load_recipe
from hexq.eval.perplexity import make_windows
from hexq.export.command import export_artifact
from hexq.model.adapters import adapter_for, moe_layer_indices
from hexq.pack.stage import pack
from hexq.runtime.engine import Runtime
from scripts.make_checkpoint import write_checkpoint
from tests.conftest import from_codes

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "tests" / "baselines" / "recipes" / "gate-haq-w8a8.yaml"  # HAQ W8A8, experts 8-bit, pack bits [8]
PPL_TOLERANCE = 0.005
LOGIT_REL_L2 = 0.1
WINDOWS, SEQLEN = 8, 128

# (write_checkpoint overrides, layers, the MoE layers that must come out of the config)
FAMILIES = {
    "mixtral": ({}, None, [0, 1]),
    "qwen3_moe": ({"mlp_only_layers": [1]}, 3, [0, 2]),  # a dense layer between two MoE layers
    "qwen2_moe": ({}, None, [0, 1]),  # shared expert with its sigmoid gate
    "olmoe": ({}, None, [0, 1]),  # q_norm / k_norm over the whole projection
    # V2-Lite shapes (q_lora_rank None, 2 shared experts), first layer dense, group-limited greedy routing
    "deepseek_v2": ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}, 3, [1, 2]),
    # q_lora_rank (q_a_layernorm), router bias, noaux_tc group-limited top-k; two dense first layers
    "deepseek_v3": ({"first_k_dense_replace": 2}, 4, [2, 3]),
    "phimoe": ({}, None, [0, 1]),  # LayerNorm with bias, sparsemixer, attention and head biases
}


@dataclass(frozen=True)
class FamilyRun:
    family: str
    model: Path
    calibration: Path
    artifact: Path
    export: Path
    export_summary: object
    moe_layers: list[int]


def small_recipe():
    recipe = load_recipe(RECIPE)
    return replace(recipe, calibration=Calibration(num_samples=8, seqlen=64, seed=0))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_run(request, tmp_path_factory) -> FamilyRun:
    family = request.param
    overrides, layers, moe_layers = FAMILIES[family]
    root = tmp_path_factory.mktemp(family)
    model = write_checkpoint(root / "model", family, layers=layers, **overrides)
    calibrate(model, small_recipe(), "bundled", root / "cal")
    pack(root / "cal", root / "art.hexq")
    summary = export_artifact(root / "art.hexq", root / "ct", windows=2, seqlen=32)
    return FamilyRun(family, model, root / "cal", root / "art.hexq", root / "ct", summary, moe_layers)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is faster than two on a shared machine (restored after the module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def heldout_windows() -> torch.Tensor:
    """The first windows of held-out austen in the tokenizer every written checkpoint ships (models/tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "tokenizer")
    return make_windows(tokenize(tokenizer, eval_text("austen")), SEQLEN, WINDOWS)


def full_precision_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def logits_of(model, windows: torch.Tensor) -> torch.Tensor:
    return model(input_ids=windows, use_cache=False).logits.float()


def perplexity(logits: torch.Tensor, windows: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    return float(nll.exp())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


# ------------------------------------------------------------------------------------------ the matrix


def test_calibration_stores_dense_layers_and_reports_every_group(family_run):
    config = json.loads((family_run.model / "config.json").read_text())
    adapter = adapter_for(config["model_type"])
    manifest = read_json(family_run.calibration / "manifest.json")
    assert manifest["model"]["moe_layers"] == moe_layer_indices(adapter, config) == family_run.moe_layers
    attention_groups = {"attn_in", "q_a", "kv_a"} if config.get("q_lora_rank") else \
        {"attn_in", "kv_a"} if config["model_type"].startswith("deepseek") else {"attn_in"}
    for index, layer in enumerate(manifest["layers"]):
        meta = read_json(family_run.calibration / f"layer_{index:03d}.json")
        dense = index not in family_run.moe_layers
        assert meta.get("dense", False) == dense
        assert set(meta["smoothing"]) == attention_groups | {"moe_in"}
        for group, entry in meta["smoothing"].items():  # HAQ ran on every group of every layer, dense ones too
            assert entry["method"] == "haq" and 0.0 <= entry["exponent"] <= 1.0, (index, group, entry)
            assert entry["error"] <= entry["error_without_smoothing"] * (1 + 1e-6), (index, group, entry)
        assert "self_attn.o_proj.weight" in meta["unsmoothed"]
        assert ("mlp.down_proj.weight" if dense else "mlp.experts.down_proj") in meta["unsmoothed"]
        assert not set(meta["unsmoothed"]) & {"self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
                                              "mlp.experts.gate_up_proj", "mlp.gate_proj.weight"}
        assert layer["layer"] == index


def test_artifact_keeps_the_models_layer_indices(family_run):
    artifact = Artifact(family_run.artifact)
    assert artifact.moe_layers == family_run.moe_layers
    assert len(artifact.allocation) == len(family_run.moe_layers)
    assert all(bits == 8 for row in artifact.allocation for bits in row)
    quantized = artifact.quantized_linears
    for index in range(artifact.num_layers):
        keys = artifact.keys(dense_shard(index))
        if index in family_run.moe_layers:
            assert not any(".mlp.gate_proj." in key or ".mlp.down_proj." in key for key in keys)
        else:  # a dense layer's MLP is stored quantized like the attention, and it has no expert shard
            for name in ("gate_proj", "up_proj", "down_proj"):
                weight = f"model.layers.{index}.mlp.{name}.weight"
                assert quantized[weight] == 8 and f"{weight}.codes" in keys
            assert f"experts/layer_{index:03d}.safetensors" not in artifact.files


def test_served_artifact_is_close_to_full_precision(family_run):
    windows = heldout_windows()
    full = logits_of(full_precision_model(family_run.model), windows)
    with Runtime(family_run.artifact) as runtime:
        served = runtime.forward(windows).logits.float()
    assert rel_l2(served, full) <= LOGIT_REL_L2
    fp_ppl, ppl = perplexity(full, windows), perplexity(served, windows)
    assert abs(ppl / fp_ppl - 1) <= PPL_TOLERANCE, (ppl, fp_ppl)


def test_runtime_bookkeeping_skips_dense_layers(family_run):
    """The cache and the look-ahead work in MoE rows: under a budget for a few experts, with prefetching, the static
    policy computes exactly what it computes with every expert resident, and every prediction lands on a MoE row."""
    windows = heldout_windows()[:2]
    with Runtime(family_run.artifact, prefetch=False) as runtime:
        resident = torch.cat([runtime.forward(window[None]).logits for window in windows])
    with Runtime(family_run.artifact) as probe:
        one = probe.plan.expert_bytes // (len(family_run.moe_layers) * probe.artifact.num_experts)
    with Runtime(family_run.artifact, fast_tier_bytes=3 * one) as runtime:
        cached = torch.cat([runtime.forward(window[None]).logits for window in windows])
        stats = runtime.stats()
    assert torch.equal(cached, resident)
    assert stats.cache.evictions + stats.cache.bypass_loads > 0
    assert stats.prefetch.used > 0 and stats.prefetch.predicted > 0
    rows = set(stats.cache.layer_hits) | set(stats.cache.layer_misses)
    assert rows == set(range(len(family_run.moe_layers)))


def test_export_reloads_in_transformers_under_the_hub_names(family_run):
    """hexq's own check (compressed-tensors' decompressors, every key read) passed; transformers' loader finds every
    key where the family's conversion mapping expects it, and the dequantized model computes like the served one."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    check = family_run.export_summary.check
    assert check.passed and check.vs_served.rel_l2 <= 1e-2  # an unread key fails the check
    assert check.vs_full_precision is not None and check.vs_full_precision.rel_l2 <= LOGIT_REL_L2
    state = {}
    for shard in sorted(family_run.export.glob("*.safetensors")):
        state |= load_file(shard)
    dense = CompressedTensorsDequantizer(family_run.export, dtype=torch.float32).validate(state)
    config = AutoConfig.from_pretrained(family_run.export, local_files_only=True)
    del config.quantization_config
    model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=dense, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    windows = heldout_windows()[:2]
    full = logits_of(full_precision_model(family_run.model), windows)
    reloaded = logits_of(model.eval(), windows)  # dequantized weights, activations in full precision
    assert rel_l2(reloaded, full) <= LOGIT_REL_L2


def mixed_recipe():
    recipe = load_recipe("experts-mixed")
    return replace(recipe, calibration=Calibration(num_samples=8, seqlen=64, seed=0),
                   smoothing=replace(recipe.smoothing, groups=("attention", "moe")))


@pytest.fixture(scope="module")
def mixed_deepseek(tmp_path_factory) -> Path:
    """DeepSeek-V3 (two dense first layers) calibrated with experts-mixed, MoE group selected, packed at 2.5 bits by
    the recipe's allocator without 0-bit experts (compressed-tensors cannot express them, and the test exports)."""
    from hexq.pack.stage import Budget

    root = tmp_path_factory.mktemp("mixed-deepseek")
    overrides, layers, _moe_layers = FAMILIES["deepseek_v3"]
    model = write_checkpoint(root / "model", "deepseek_v3", layers=layers, **overrides)
    recipe = mixed_recipe()
    calibrate(model, recipe, "bundled", root / "cal")
    exportable = replace(recipe.pack, widths=tuple(b for b in recipe.pack.widths if b))
    pack(root / "cal", root / "art.hexq", exportable, Budget(avg_bits=2.5))
    return root


def test_dense_layers_are_smoothed_at_the_dense_setting_in_a_mixed_precision_model(mixed_deepseek):
    """experts-mixed keeps the routed experts' activations in full precision but quantizes the attention and a dense
    layer's MLP at W8A8: the post-attention group of a dense layer is smoothed (its MLP reads 8-bit activations),
    that of a MoE layer is skipped; the 2.5-bit artifact serves and exports with its dense first layers."""
    _overrides, layers, moe_layers = FAMILIES["deepseek_v3"]
    for index in range(layers):
        entry = read_json(mixed_deepseek / "cal" / f"layer_{index:03d}.json")["smoothing"]["moe_in"]
        if index in moe_layers:
            assert "activations of this group are not quantized" in entry["skipped"]
        else:
            assert entry["method"] == "haq" and "exponent" in entry
    artifact = Artifact(mixed_deepseek / "art.hexq")
    assert artifact.moe_layers == moe_layers and len({b for row in artifact.allocation for b in row}) > 1
    windows = heldout_windows()[:2]

    def forward(runtime: Runtime) -> torch.Tensor:  # the layouts' products differ in rounding, expanded codes do not
        return from_codes(runtime).forward(windows).logits

    with Runtime(artifact.path, prefetch=False) as runtime:
        resident = forward(runtime)
    with Runtime(artifact.path, fast_tier_bytes=runtime.plan.expert_bytes // 8) as runtime:
        assert torch.equal(forward(runtime), resident)
        one = runtime.source.sizes.largest_slot
    # room for one expert: a layer's other experts are computed from transient loads whatever the cost model says
    with Runtime(artifact.path, fast_tier_bytes=one, prefetch=False) as runtime:
        assert torch.equal(forward(runtime), resident)
        assert runtime.cache.stats.bypass_loads > 0
    summary = export_artifact(artifact.path, mixed_deepseek / "ct", windows=2, seqlen=32)
    assert summary.check.passed and summary.check.vs_served.rel_l2 <= 1e-2


@pytest.mark.slow
def test_report_labels_moe_rows_with_their_model_layers(mixed_deepseek):
    from hexq.report.page import write_report

    page = write_report(mixed_deepseek / "art.hexq", mixed_deepseek / "report").read_text()
    assert "<th>layer 2</th>" in page and "<th>layer 3</th>" in page and "<th>layer 0</th>" not in page


@pytest.mark.parametrize("done", [1, 2])  # killed after the last dense layer, after the first MoE layer
def test_a_resumed_calibration_rebuilds_dense_and_moe_layers_byte_for_byte(mixed_deepseek, tmp_path, done):
    import shutil

    out, partial = tmp_path / "resumed", tmp_path / ".resumed.partial"
    shutil.copytree(mixed_deepseek / "cal", partial)
    _overrides, layers, _moe_layers = FAMILIES["deepseek_v3"]
    for index in range(done, layers):
        for suffix in (".safetensors", ".json", ".bank.safetensors"):
            (partial / f"layer_{index:03d}{suffix}").unlink(missing_ok=True)
    (partial / "manifest.json").unlink()
    progress = json.loads((partial / "progress.json").read_text())
    (partial / "progress.json").write_text(json.dumps(progress | {"layers_done": done}))
    assert calibrate(mixed_deepseek / "model", mixed_recipe(), "bundled", out).resumed_from == done

    def folder_bytes(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "timings.json"}

    assert folder_bytes(out) == folder_bytes(mixed_deepseek / "cal")
