"""Routing skew of the checkpoints scripts/make_checkpoint.py writes: each family's expert choice, the hot-quarter
share, calibrating the router scales to a target share, and measuring the share that was written."""

import contextlib
import functools
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `hexq` importable from the checkout
    sys.path.insert(0, str(ROOT))

from hexq.base.errors import HexqError  # noqa: E402
from scripts.checkpoint_families import is_moe_layer, num_experts, weight_files  # noqa: E402


def normal_quantiles(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard-normal quantiles at (i + 0.5) / count: an evenly spread, symmetric profile."""
    p = (torch.arange(count, dtype=torch.float64, device=device) + 0.5) / count
    return math.sqrt(2.0) * torch.special.erfinv(2.0 * p - 1.0)


def router_scales(num_experts: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """Row scales s_e = exp(alpha * q_e), q = normal quantiles in a seeded order (see the docstring)."""
    order = torch.randperm(num_experts, generator=generator)
    return torch.exp(alpha * normal_quantiles(num_experts)[order]).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Routing: each family's expert choice, the hot-quarter share, and the skew calibration


def select_experts(config: dict, logits: torch.Tensor, score_bias: torch.Tensor | None = None) -> torch.Tensor:
    """[N, k] expert indices the family's router picks from router logits [N, E] (inference mode).

    Softmax-then-top-k (Mixtral, Qwen, OLMoE, DeepSeek-V2 greedy) and PhiMoE's sparsemixer at inference (the
    arg-max, then the arg-max of the rest) all pick the k largest logits. DeepSeek-V2 group_limited_greedy keeps
    the topk_group groups with the largest max score; DeepSeek-V3 noaux_tc ranks sigmoid(logit) + bias, keeps
    the topk_group groups with the largest sum of their two best, and takes the top k inside them."""
    k, method = config["num_experts_per_tok"], config.get("topk_method", "greedy")
    if config["model_type"] == "deepseek_v3" or method == "noaux_tc":
        scores = logits.float().sigmoid()
        if score_bias is not None:
            scores = scores + score_bias.to(device=scores.device, dtype=scores.dtype)
        group_scores = scores.unflatten(-1, (config["n_group"], -1)).topk(2, dim=-1).values.sum(-1)
    elif method == "group_limited_greedy":
        scores = logits.float().softmax(dim=-1)
        group_scores = scores.unflatten(-1, (config["n_group"], -1)).amax(dim=-1)
    else:
        return logits.topk(k, dim=-1).indices
    groups = group_scores.topk(config["topk_group"], dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.repeat_interleave(scores.shape[-1] // config["n_group"], dim=-1)
    return scores.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices


def quarter(num_experts: int) -> int:
    return max(1, round(num_experts / 4))


def hot_quarter_share(indices: torch.Tensor, num_experts: int) -> float:
    """Share of routed (token, slot) pairs taken by the most-used quarter of the experts (at least one)."""
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts)
    return float(counts.sort(descending=True).values[:quarter(num_experts)].sum() / counts.sum())


def modelled_share(config: dict, alpha: float, samples: int = 4000, layers: int = 8, seed: int = 0) -> float:
    """Mean hot-quarter share under the skew model: independent N(0, s_e^2) logits through the family's
    selection, over `layers` seeded orders of the scales (with group-limited routing the order matters).

    The quarter is the one with the largest scales, not the most-used quarter of this sample: that is the
    large-sample limit, free of the upward bias a post-hoc pick of the busiest experts has on few tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    experts = num_experts(config)
    shares = []
    for _ in range(layers):
        scales = router_scales(experts, alpha, g)
        logits = torch.randn(samples, experts, generator=g) * scales
        bias = torch.randn(experts, generator=g) * 0.01 if config["model_type"] == "deepseek_v3" else None
        counts = torch.bincount(select_experts(config, logits, bias).reshape(-1), minlength=experts)
        shares.append(float(counts[scales.topk(quarter(experts)).indices].sum() / counts.sum()))
    return sum(shares) / layers


def calibrate_alpha(config: dict, target: float) -> float:
    """The alpha whose modelled hot-quarter share is `target` (bisection; the share grows with alpha).

    It depends only on the routing fields of the config, so it is computed once per routing shape."""
    if not 0.25 <= target < 1.0:
        raise HexqError(f"--skew {target} must be a share in [0.25, 1): 0.25 is unskewed, real routers ~0.31-0.43")
    routing = {key: config.get(key) for key in ("model_type", "num_experts_per_tok", "topk_method", "n_group",
                                                "topk_group")}
    return _calibrated_alpha(tuple(sorted(routing.items())), num_experts(config), float(target))


@contextlib.contextmanager
def one_thread():
    """Small tensor ops run several times faster on one thread than on a shared pool (restored on exit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=64)
def _calibrated_alpha(routing: tuple, experts: int, target: float) -> float:
    if target == 0.25:
        return 0.0
    with one_thread():
        return _bisect_alpha(dict(routing) | {"num_experts": experts}, experts, target)


def _bisect_alpha(config: dict, experts: int, target: float) -> float:
    low, high = 0.0, 4.0
    if modelled_share(config, high) < target:
        raise HexqError(f"--skew {target} is out of reach for {config['model_type']} with {experts} experts, "
                        f"top-{config['num_experts_per_tok']}")
    for _ in range(14):  # alpha to 4 / 2^14
        mid = 0.5 * (low + high)
        if modelled_share(config, mid) < target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)




# ---------------------------------------------------------------------------------------------------------------
# Measuring the skew that was written


def router_keys(config: dict) -> list[tuple[str, str | None]]:
    """(router weight, score bias or None) per MoE layer, as named in the files."""
    block = "block_sparse_moe" if config["model_type"] in ("mixtral", "phimoe") else "mlp"
    keys = []
    for layer in range(config["num_hidden_layers"]):
        if is_moe_layer(config, layer):
            prefix = f"model.layers.{layer}.{block}.gate"
            keys.append((f"{prefix}.weight",
                         f"{prefix}.e_score_correction_bias" if config["model_type"] == "deepseek_v3" else None))
    return keys


def shares_on_random_inputs(folder: Path, samples: int = 16384, seed: int = 0, batch: int = 2048) -> list[float]:
    """Hot-quarter share per MoE layer for router inputs x = sqrt(H) g/|g| (unit RMS, like a norm's output),
    read from the written router weights."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    files = weight_files(folder)
    shares = []
    for weight_key, bias_key in router_keys(config):
        with safe_open(folder / files[weight_key], "pt") as f:
            weight = f.get_tensor(weight_key).float()
        bias = None
        if bias_key is not None:
            with safe_open(folder / files[bias_key], "pt") as f:
                bias = f.get_tensor(bias_key).float()
        g = torch.Generator(device="cpu").manual_seed(seed)
        counts = torch.zeros(weight.shape[0], dtype=torch.int64)
        for start in range(0, samples, batch):
            x = torch.randn(min(batch, samples - start), config["hidden_size"], generator=g)
            x *= config["hidden_size"] ** 0.5 / x.norm(dim=-1, keepdim=True)
            counts += torch.bincount(select_experts(config, x @ weight.T, bias).reshape(-1), minlength=len(counts))
        shares.append(float(counts.sort(descending=True).values[:quarter(len(counts))].sum() / counts.sum()))
    return shares


def routed_indices(output) -> torch.Tensor:
    """Expert indices from a transformers 5.x router's output (router_logits, scores, indices)."""
    return output[-1]


def corpus_windows(tokenizer, seqlen: int = 256, windows_per_corpus: int = 2) -> torch.Tensor:
    """[W, seqlen] token ids: the first windows of each training corpus (austen, pydocs, foldoc)."""
    from hexq.base.data import TRAIN_CORPORA, corpus_text

    windows = []
    for name in TRAIN_CORPORA:
        text = corpus_text(name, "train")[: 16 * seqlen * windows_per_corpus]  # ample: a token is a few bytes
        ids = tokenizer(text)["input_ids"]
        windows += [ids[i * seqlen:(i + 1) * seqlen] for i in range(windows_per_corpus)]
    return torch.tensor(windows, dtype=torch.long)


def shares_on_text(model, input_ids: torch.Tensor) -> list[float]:
    """Hot-quarter share per MoE layer of a loaded transformers model over `input_ids` (router outputs hooked)."""
    config = model.config.to_dict()
    captured: dict[int, list[torch.Tensor]] = {}
    routers = [(i, layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate)
               for i, layer in enumerate(model.model.layers) if is_moe_layer(config, i)]
    hooks = []
    try:
        for i, router in routers:
            hooks.append(router.register_forward_hook(
                lambda _module, _args, output, i=i: captured.setdefault(i, []).append(routed_indices(output))))
        with torch.no_grad():
            model(input_ids=input_ids.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return [hot_quarter_share(torch.cat(captured[i]), num_experts(config)) for i, _ in routers]


def load_for_measurement(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, model_max_length=1 << 30)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tokenizer
