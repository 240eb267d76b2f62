import pytest
import torch

from hexq.algos import smoothing as smoothing_mod
from hexq.algos.quant import QuantSpec, fake_quantize
from hexq.algos.smoothing import (
    activation_channel_max,
    exponent_grid,
    joint_w8a8_error,
    search_exponent,
    search_exponent_routed,
    smoothing_scales,
    smoothquant_scales,
    weight_channel_max,
)
from hexq.calib.fold import ATTN_IN, MOE_IN, fold_scales, smoothing_groups
from hexq.model.adapters import adapter_for
from tests.conftest import TINY_CONFIGS, HexqFactoriesOnMeta, build_tiny_model

W8 = QuantSpec(bits=8)


def outlier_activations(tokens: int = 64, channels: int = 16, outliers=(3, 11), factor: float = 50.0, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=generator)
    x[:, list(outliers)] *= factor
    return x


def random_weights(shapes, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) * 0.1 for shape in shapes]


def naive_joint_error(weights, x, s, w_spec, a_bits):
    """Eq. 1 written out: per-token asymmetric min/max activation grid, one weight at a time, in float64."""
    xs = (x / s).double()
    lo, hi = xs.amin(dim=1, keepdim=True).clamp(max=0), xs.amax(dim=1, keepdim=True).clamp(min=0)
    step = ((hi - lo) / (2**a_bits - 1)).clamp(min=1e-8)
    zero = torch.round(-lo / step)
    xq = (torch.clamp(torch.round(xs / step + zero), 0, 2**a_bits - 1) - zero) * step
    total = 0.0
    for w in weights:
        wq = fake_quantize((w * s).float(), w_spec).double() if w_spec else (w * s).double()
        total += float((xq @ wq.T - x.double() @ w.double().T).pow(2).sum())
    return total


# ---- algos.smoothing: pure functions ------------------------------------------------------------------------------


def test_exponent_zero_means_no_smoothing():
    act_max = torch.tensor([0.0, 1e-9, 0.3, 2.0, 75.0])
    assert torch.equal(smoothing_scales(act_max, None, 0.0), torch.ones(5))
    weights = random_weights([(8, 5)])
    x = torch.randn(10, 5)
    assert joint_w8a8_error(weights, x, smoothing_scales(act_max, None, 0.0), W8, 8) == \
        joint_w8a8_error(weights, x, torch.ones(5), W8, 8)


def test_haq_scales_are_act_max_to_the_e_and_dead_channels_keep_one():
    act_max = torch.tensor([0.0, 0.5, 2.0, 64.0])
    s = smoothing_scales(act_max, None, 0.5)
    assert s[0] == 1.0  # a channel never active in calibration is left alone, not divided by ~0
    assert torch.allclose(s[1:], act_max[1:].sqrt())
    assert torch.allclose(smoothing_scales(act_max, None, 1.0)[1:], act_max[1:])


def test_smoothquant_alpha_half_balances_activation_and_weight_ranges():
    x = outlier_activations()
    weights = random_weights([(24, 16), (8, 16)])
    act_max, w_max = activation_channel_max(x), weight_channel_max(weights)
    s = smoothquant_scales(act_max, weights, alpha=0.5)
    assert torch.allclose(s, (act_max / w_max).sqrt())
    # alpha = 0.5 leaves max|X/s| = max|W s| = sqrt(max|X| max|W|) on every channel
    assert torch.allclose(activation_channel_max(x / s), weight_channel_max([w * s for w in weights]), rtol=1e-5)
    assert torch.allclose(smoothing_scales(act_max, w_max, 0.5), s)


def test_scales_reject_bad_input():
    with pytest.raises(ValueError, match="exponent"):
        smoothing_scales(torch.ones(3), None, 1.5)
    with pytest.raises(ValueError, match="act_max"):
        smoothing_scales(torch.tensor([1.0, -1.0]), None, 0.5)
    with pytest.raises(ValueError, match="weight_max"):
        smoothing_scales(torch.ones(3), torch.ones(4), 0.5)
    with pytest.raises(ValueError, match="divide 1"):
        exponent_grid(0.3)


def test_joint_error_matches_eq1_written_out():
    x = outlier_activations()
    weights = random_weights([(24, 16), (8, 16)])
    s = smoothing_scales(activation_channel_max(x), None, 0.6)
    for w_spec, a_bits in ((W8, 8), (QuantSpec(bits=4), 4), (None, 6)):
        fast = joint_w8a8_error(weights, x, s, w_spec, a_bits)
        assert fast == pytest.approx(naive_joint_error(weights, x, s, w_spec, a_bits), rel=1e-4)


def test_joint_error_treats_fused_experts_row_by_row_and_honours_fp_flags():
    x = outlier_activations()
    gate_up, router = random_weights([(4, 12, 16), (4, 16)])
    s = smoothing_scales(activation_channel_max(x), None, 0.5)
    per_expert = sum(joint_w8a8_error([expert], x, s, W8, 8) for expert in gate_up)
    assert joint_w8a8_error([gate_up.reshape(-1, 16)], x, s, W8, 8) == pytest.approx(per_expert, rel=1e-6)
    mixed = joint_w8a8_error([router, gate_up.reshape(-1, 16)], x, s, W8, 8, quantize_weights=[False, True])
    assert mixed == pytest.approx(joint_w8a8_error([router], x, s, None, 8) + per_expert, rel=1e-6)


def test_search_picks_the_grid_minimum_and_migrates_outliers():
    x = outlier_activations()
    weights = random_weights([(24, 16), (8, 16)])
    result = search_exponent(weights, x, grid_step=0.05)
    act_max = activation_channel_max(x)
    brute = [joint_w8a8_error(weights, x, smoothing_scales(act_max, None, e), W8, 8) for e in exponent_grid(0.05)]
    assert result.grid == exponent_grid(0.05) and len(result.grid) == 21
    assert list(result.errors) == pytest.approx(brute, rel=1e-9)
    assert result.error == min(brute)
    assert result.exponent == result.grid[brute.index(min(brute))]
    assert torch.equal(result.scales, smoothing_scales(act_max, None, result.exponent))
    assert result.baseline_error == brute[0]
    assert result.exponent > 0 and result.error < 0.5 * result.baseline_error
    again = search_exponent(weights, x, grid_step=0.05)  # deterministic
    assert again.exponent == result.exponent and again.errors == result.errors


def test_search_ties_go_to_the_smallest_exponent():
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    weights = random_weights([(8, 8)])
    # every channel max is 1, so s = 1^e = 1 for every e: all grid errors are equal
    result = search_exponent(weights, x, act_max=torch.ones(8), grid_step=0.25)
    assert len(set(result.errors)) == 1
    assert result.exponent == 0.0 and torch.equal(result.scales, torch.ones(8))


def test_smoothquant_search_reports_the_unsmoothed_baseline():
    x = outlier_activations()
    weights = random_weights([(24, 16)])
    w_max = weight_channel_max(weights)
    result = search_exponent(weights, x, grid_step=0.25, weight_max=w_max)
    assert result.baseline_error == joint_w8a8_error(weights, x, torch.ones(16), W8, 8)
    assert result.errors[2] == joint_w8a8_error(weights, x, smoothquant_scales(activation_channel_max(x), weights),
                                                W8, 8)


# ---- algos.smoothing: routed objective for the MoE group ------------------------------------------------------------


def moe_group(experts: int = 5, seed: int = 2):
    """x [64, 16] with outliers, top-2 routing [64, 2] (with ids -1 and E to ignore, and one duplicate), gate_up
    [E, 12, 16], router [E, 16] (full precision) and a shared expert [8, 16] (quantized)."""
    x = outlier_activations(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    routing = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(64)])
    routing[0, 1] = -1
    routing[1, 0] = experts
    routing[2] = routing[2, 0]  # the same expert listed twice counts once
    routing[routing == experts - 1] = 0  # expert E-1 is never routed
    gate_up, router, shared = random_weights([(experts, 12, 16), (experts, 16), (8, 16)], seed=seed)
    return x, routing, gate_up, router, shared


def brute_force_routed(x, routing, gate_up, router, shared, s, w_spec, a_bits):
    """The routed objective written out: eq. 1 (joint_w8a8_error, itself checked against the written-out formula
    above) for each expert on exactly the tokens that list it, one expert at a time, plus the dense readers."""
    total = joint_w8a8_error([router, shared], x, s, w_spec, a_bits, quantize_weights=[False, True])
    for expert in range(gate_up.shape[0]):
        tokens = (routing == expert).any(dim=1)
        if tokens.any():
            total += joint_w8a8_error([gate_up[expert]], x[tokens], s, w_spec, a_bits)
    return total


@pytest.mark.parametrize(("w_spec", "a_bits"), [(W8, 8), (QuantSpec(bits=4, group_size=8, symmetric=False), 4)])
def test_routed_search_matches_brute_force(w_spec, a_bits):
    x, routing, gate_up, router, shared = moe_group()
    act_max = activation_channel_max(x)
    result = search_exponent_routed(x, routing, act_max, 0.25, experts=gate_up,
                                    dense=[(router, False), (shared, True)], w_spec=w_spec, a_bits=a_bits,
                                    chunk_elements=12 * 16 * 2)  # two experts per chunk, several token slices
    brute = [brute_force_routed(x, routing, gate_up, router, shared, smoothing_scales(act_max, None, e), w_spec,
                                a_bits) for e in exponent_grid(0.25)]
    assert list(result.errors) == pytest.approx(brute, rel=1e-6)
    assert result.exponent == result.grid[brute.index(min(brute))]
    assert result.baseline_error == result.errors[0]
    assert torch.equal(result.scales, smoothing_scales(act_max, None, result.exponent))


def test_routed_search_with_every_token_routed_equals_search_exponent():
    x, _, gate_up, router, shared = moe_group()
    everyone = torch.arange(5).expand(64, 5)
    routed = search_exponent_routed(x, everyone, None, 0.1, experts=gate_up, dense=[(router, False), (shared, True)])
    old = search_exponent([router, gate_up.reshape(-1, 16), shared], x, None, 0.1,
                          quantize_weights=[False, True, True])
    assert list(routed.errors) == pytest.approx(list(old.errors), rel=1e-5)
    assert routed.exponent == old.exponent and routed.baseline_error == pytest.approx(old.baseline_error, rel=1e-5)


def test_routed_search_chunking_and_work_counts(monkeypatch):
    """Chunk size changes nothing; targets are built once per search and each routed expert's weights are
    quantized once per grid point (never-routed experts not at all)."""
    x, routing, gate_up, router, shared = moe_group()
    kwargs = dict(experts=gate_up, dense=[(router, False), (shared, True)])
    whole = search_exponent_routed(x, routing, None, 0.25, **kwargs)
    rows_quantized, builds = [], []
    original_fq, original_chunks = smoothing_mod.fake_quantize, smoothing_mod._routed_chunks

    def counting_fq(w, spec):
        rows_quantized.append(w.shape[0])
        return original_fq(w, spec)

    def counting_chunks(*args):
        chunks = original_chunks(*args)
        builds.append([len(chunk.slices) for chunk in chunks])
        return chunks

    monkeypatch.setattr(smoothing_mod, "fake_quantize", counting_fq)
    monkeypatch.setattr(smoothing_mod, "_routed_chunks", counting_chunks)
    chunked = search_exponent_routed(x, routing, None, 0.25, chunk_elements=12 * 16, **kwargs)
    assert list(chunked.errors) == pytest.approx(list(whole.errors), rel=1e-6)
    assert len(builds) == 1 and len(builds[0]) == 4 and max(builds[0]) > 1  # 4 routed experts alone, sliced
    assert sum(rows_quantized) == 5 * (4 * 12 + 8)  # per grid point: routed experts' rows and the shared expert


def test_routed_search_rejects_bad_input_and_runs_with_meta_default_device():
    x, routing, gate_up, router, shared = moe_group()
    with pytest.raises(ValueError, match="experts must be"):
        search_exponent_routed(x, routing, experts=gate_up[:, :, :8])
    with pytest.raises(ValueError, match="routing"):
        search_exponent_routed(x, routing[:10], experts=gate_up)
    with pytest.raises(ValueError, match="routing"):
        search_exponent_routed(x, routing.float(), experts=gate_up)
    want = search_exponent_routed(x, routing, None, 0.25, experts=gate_up, dense=[(router, False), (shared, True)])
    with HexqFactoriesOnMeta():
        got = search_exponent_routed(x, routing, None, 0.25, experts=gate_up, dense=[(router, False), (shared, True)])
    assert got.errors == want.errors and got.scales.device.type == "cpu"


# ---- calib.smooth: groups and folding on every family -------------------------------------------------------------

FAMILIES = sorted(TINY_CONFIGS)
IDS = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(0))


def randomize_norms(model, seed: int = 0) -> None:
    """Random init leaves norms at weight 1 / bias 0; make them generic so folding into them is really tested."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name and param.dim() == 1:
                param.copy_(torch.empty_like(param).uniform_(0.5, 1.5, generator=generator)
                            if name.endswith("weight") else 0.1 * torch.randn(param.shape, generator=generator))


def run_with_routing(model, adapter):
    """Logits and each layer's chosen experts (sorted per token) on the fixed input ids."""
    chosen = []
    routers = [layer.get_submodule(f"{adapter.moe}.{adapter.router}") for layer in model.model.layers
               if isinstance(getattr(layer, adapter.moe), torch.nn.Module)
               and hasattr(getattr(layer, adapter.moe), adapter.router)]
    handles = [router.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].sort(dim=-1).values))
               for router in routers]
    try:
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, chosen


def fold_random_scales(model, adapter, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for group in smoothing_groups(layer, adapter):
            fold_scales(group, torch.empty(group.channels).uniform_(-1.5, 1.5, generator=generator).exp())


QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
SHARED = ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]
EXPECTED_GROUPS = {  # group -> readers (weight paths without ".weight"), as transformers' modeling code wires them
    "mixtral": {"attn_in": QKV, "moe_in": ["mlp.gate", "mlp.experts.gate_up_proj"]},
    "qwen3_moe": {"attn_in": QKV, "moe_in": ["mlp.gate", "mlp.experts.gate_up_proj"]},
    "olmoe": {"attn_in": QKV, "moe_in": ["mlp.gate", "mlp.experts.gate_up_proj"]},
    "phimoe": {"attn_in": QKV, "moe_in": ["mlp.router", "mlp.experts.gate_up_proj"]},
    "qwen2_moe": {"attn_in": QKV, "moe_in": ["mlp.gate", "mlp.experts.gate_up_proj", "mlp.shared_expert.gate_proj",
                                             "mlp.shared_expert.up_proj", "mlp.shared_expert_gate"]},
    # MLA: q_lora_rank None (V2-Lite) reads q_proj; with q_lora_rank, q_a_proj -> q_a_layernorm -> q_b_proj
    "deepseek_v2": {"attn_in": ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"],
                    "kv_a": ["self_attn.kv_b_proj"], "moe_in": ["mlp.gate", "mlp.experts.gate_up_proj", *SHARED]},
    "deepseek_v3": {"attn_in": ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"], "q_a": ["self_attn.q_b_proj"],
                    "kv_a": ["self_attn.kv_b_proj"], "moe_in": ["mlp.gate", "mlp.experts.gate_up_proj", *SHARED]},
}


def reader_names(group) -> list[str]:
    return [r.name.removesuffix(".weight") for r in group.readers]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_groups_name_every_weight_that_reads_each_norm(model_type):
    model, adapter = build_tiny_model(model_type), adapter_for(model_type)
    layer = model.model.layers[0]
    groups = smoothing_groups(layer, adapter)
    assert {g.name: reader_names(g) for g in groups} == EXPECTED_GROUPS[model_type]
    assert (groups[0].name, groups[-1].name) == (ATTN_IN, MOE_IN)
    assert [r.quantized for r in groups[-1].readers][0] is False  # the router stays in full precision

    # Completeness, traced: every module owning parameters whose input IS a norm's output must be a reader, and a
    # norm no group names must feed no linear (Qwen3-MoE / OLMoE q_norm, k_norm feed the attention product).
    norm_outputs, inputs = {}, {}

    def record_input(module, args, kwargs) -> None:
        inputs[module] = args[0] if args else kwargs.get("hidden_states")

    norms = {module for name, module in layer.named_modules() if "norm" in name.rsplit(".", 1)[-1]}
    handles = [norm.register_forward_hook(lambda m, _i, out: norm_outputs.update({m: out})) for norm in norms]
    for module in layer.modules():
        if next(module.parameters(recurse=False), None) is not None and module not in norms:
            handles.append(module.register_forward_pre_hook(record_input, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=IDS)
    finally:
        for handle in handles:
            handle.remove()
    by_norm = {group.norm: group for group in groups}
    for norm, out in norm_outputs.items():
        out = out.reshape(-1, out.shape[-1])
        readers_seen = {m for m, x in inputs.items() if isinstance(x, torch.Tensor) and x.numel() == out.numel()
                        and torch.equal(x.reshape(-1, out.shape[-1]), out)}
        expected = {reader.module for reader in by_norm[norm].readers} if norm in by_norm else set()
        assert readers_seen == expected, (model_type, by_norm[norm].name if norm in by_norm else norm)
    assert set(by_norm) <= set(norm_outputs)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_folding_random_scales_preserves_logits_and_routing(model_type):
    model, adapter = build_tiny_model(model_type), adapter_for(model_type)
    randomize_norms(model)
    logits, routes = run_with_routing(model, adapter)
    norm_before = model.model.layers[1].post_attention_layernorm.weight.clone()
    fold_random_scales(model, adapter)
    assert not torch.allclose(model.model.layers[1].post_attention_layernorm.weight, norm_before)
    folded_logits, folded_routes = run_with_routing(model, adapter)
    assert (folded_logits - logits).abs().max() <= 1e-4 * logits.abs().max()
    assert len(routes) == len(folded_routes) == 2
    for before, after in zip(routes, folded_routes, strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize(("model_type", "dense"), [("deepseek_v2", {"first_k_dense_replace": 1}),
                                                   ("qwen3_moe", {"mlp_only_layers": [0]})])
def test_dense_layers_fold_into_their_mlp(model_type, dense):
    model, adapter = build_tiny_model(model_type, **dense), adapter_for(model_type)
    moe = smoothing_groups(model.model.layers[0], adapter)[-1]
    assert [r.name for r in moe.readers] == ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    logits, _ = run_with_routing(model, adapter)
    fold_random_scales(model, adapter)
    folded, _ = run_with_routing(model, adapter)
    assert (folded - logits).abs().max() <= 1e-4 * logits.abs().max()


def test_fold_keeps_dtypes_and_rejects_bad_scales():
    model, adapter = build_tiny_model("phimoe").to(torch.bfloat16), adapter_for("phimoe")
    attn, moe = smoothing_groups(model.model.layers[0], adapter)
    fold_scales(moe, torch.full((moe.channels,), 2.0))
    assert moe.norm.weight.dtype == moe.norm.bias.dtype == torch.bfloat16
    assert all(reader.tensor.dtype == torch.bfloat16 for reader in moe.readers)
    for bad in (torch.zeros(attn.channels), torch.full((attn.channels,), float("inf")), torch.ones(3)):
        with pytest.raises(ValueError):
            fold_scales(attn, bad)


class _TwoRanks:
    """Ranks of a world of 2 played one after another in one process: `objects` hands back every rank's value that
    has been given so far (rank 1 runs first, so rank 0 sees both)."""

    def __init__(self, rank: int, gathered: dict) -> None:
        self.rank, self.world, self.gathered = rank, 2, gathered

    distributed = True

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def expert_range(self, tokens: list[int]) -> range:
        from hexq.calib.ranks import expert_ranges

        return expert_ranges(tokens, self.world)[self.rank]

    def objects(self, value) -> list:
        self.gathered[self.rank] = value
        return [self.gathered.get(rank, value) for rank in range(self.world)]


def test_the_routed_search_split_over_ranks_sums_to_the_single_process_search(tiny_qwen3moe):
    """Two ranks each read and score their own experts (the router's and shared expert's error on rank 0 alone); the
    per-exponent sums are one process's errors to float64 rounding, and pick the same exponent and scales."""
    from hexq.base.hidden import HiddenStore
    from hexq.calib.fold import MOE_IN
    from hexq.calib.scales import smooth_layer
    from hexq.model.streaming import open_model
    from tests.conftest import small_recipe

    streamed, _tokenizer = open_model(tiny_qwen3moe, torch.device("cpu"))
    recipe = small_recipe("haq-w8a8")
    hidden = HiddenStore()
    ids = torch.randint(0, streamed.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    kwargs = streamed.layer_inputs(ids, 4, hidden)

    def smoothed(ranks=None):
        tensors = {}
        with streamed.layer(0) as loaded:
            extra = () if ranks is None else (ranks,)
            report, _ = smooth_layer(loaded, streamed.adapter, hidden, kwargs, recipe, 0, tensors, *extra)
            read = loaded.read
        return report[MOE_IN], tensors[f"smooth.{MOE_IN}"], read

    single, single_scales, _ = smoothed()
    gathered: dict = {}
    _, _, read_1 = smoothed(_TwoRanks(1, gathered))
    split, split_scales, read_0 = smoothed(_TwoRanks(0, gathered))
    experts = streamed.config.num_experts
    assert read_0.start == 0 and read_0.stop == read_1.start and read_1.stop == experts  # each its own share
    assert split["exponent"] == single["exponent"] and torch.equal(split_scales, single_scales)
    assert split["error"] == pytest.approx(single["error"], rel=1e-9)
    assert split["error_without_smoothing"] == pytest.approx(single["error_without_smoothing"], rel=1e-9)
