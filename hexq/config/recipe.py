"""Recipes: frozen, typed configs for `hexq calibrate`, read from YAML files that map 1:1 onto them
(hexq.config.recipe_files reads the files).

A recipe file is one mapping whose keys are the fields of `Recipe`; each section is the mapping of one dataclass:

    name: haq-w8a8
    version: 1
    smoothing:   {method: haq, grid_step: 0.05, max_tokens: 2048, groups: [attention, moe]}
    weights:     {bits: 8, group_size: null, symmetric: false, method: gptq, act_order: none, damp: 0.01}
    activations: {bits: 8, dynamic: true, symmetric: false}
    experts:     {mode: uniform, min_tokens: 16, fallback_blend: 0.5}
    calibration: {num_samples: 128, seqlen: 256, seed: 0}
    pack:        {alpha: 0.5, bits: [1, 2, 3, 4], avg_bits: 3.0, schedule: uniform, placement: two_stage}

Rules (one place for each: `build` for keys and nesting, `_coerce` for types, `__post_init__` for values):
- a key left out takes the dataclass default (the defaults are the paper's HAQ W8A8 setting);
- an unknown key fails naming the key and the allowed ones; a duplicated key fails (PyYAML would keep the last);
- a wrong type fails naming the key and the expected type (an int is accepted where a number is expected);
- a key used only by another method or mode (e.g. smoothing.alpha with method haq) must stay at its default,
  so a recipe never carries a setting that is silently ignored.

The recipe stored in calibration outputs is `recipe_to_dict`; `calibration_hash` identifies it (sha256 of its
canonical JSON).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hexq.algos.hessian import ACT_ORDERS
from hexq.algos.placement import SCHEMES
from hexq.algos.quant import ONE_BIT_GRIDS, QuantSpec
from hexq.config.typed_config import (
    RecipeError,
    build,
    check_at_least,
    check_bits,
    check_choice,
    check_types,
    check_unit,
    check_unused_at_default,
    check_width_list,
    to_plain,
)

RECIPE_VERSION = 2  # 2: pack.bits (the widths an allocation may use) renamed pack.widths; version 1 is still read

WEIGHT_METHODS = ("gptq", "rtn")
SMOOTHING_METHODS = ("haq", "smoothquant", "none")
SMOOTHING_GROUPS = ("attention", "moe")  # input norm -> q,k,v; post-attention norm -> router + experts + shared
EXPERT_MODES = ("uniform", "replicas")
EXPORT_TARGETS = ("vllm", "gguf")  # experts.export_target: the grid hexq export writes routed experts on
ROUND_SCOPES = ("expert", "block")  # experts.round_scope: what a replica's rounding is optimised against
DOWN_FITS = ("full_precision", "replica")  # experts.down_fit: the input a replica's down projection is fitted to
TOKEN_WEIGHTS = ("equal", "routing")  # experts.token_weights: how a routed token counts in its expert's statistics
MOE_OBJECTIVES = ("routed", "all")  # HAQ's MoE-group objective: experts on their routed tokens, or on every token
PLACEMENT_SCHEMES = tuple(SCHEMES.values())  # 003 Algorithm 2: schemes 1, 2 and 3
# How the budget is split across layers: the same per layer, 004 §4.3's cosine (a byte budget), or not split at all
# ("model": one allocation over every layer's experts, order free; hexq.algos.allocation.allocate_model)
BUDGET_SCHEDULES = ("uniform", "cosine", "model")
PACK_LOSSES = ("expert", "layer")  # what the allocation minimises: per-expert MSE, or weighted by routing mass
PACK_ORDERS = ("importance", "free")  # widths non-increasing in importance order (002 prefix split), or any


# ------------------------------------------------------------------------------------------ dataclasses


@dataclass(frozen=True)
class WeightQuant:
    """How weights are quantized (hexq.algos.quant / hexq.algos.gptq).

    act_order, damp and block_size are GPTQ's (hexq.algos.gptq); with method "rtn" they must stay at their defaults.
    fit_bits (GPTQ only): the widths whose group grids are fitted to the weights, minimising the Hessian-weighted
    error (hexq.algos.clipping), instead of spanning each group's min and max; for a replica bank a subset of its
    widths, for one weight its `bits` or nothing; refit_bits likewise, the widths whose grids are refitted after GPTQ
    to its codes (hexq.algos.refit); clip_bits likewise, the widths whose rows each take the best of their grids over
    the whole range and narrowed ranges by GPTQ's own objective (hexq.algos.gptq.CLIP_RATIOS). one_bit: the two
    levels of an asymmetric 1-bit grid, "minmax" (each group's min and max) or "spread" (mean -+ 1.75 x the mean
    absolute deviation; hexq.algos.quant).
    float_zero_bits (asymmetric only): the widths (2 and up) whose grids span each group's min and max with a float
    zero point, instead of widening the range to include 0 with an integer zero point (which compressed-tensors can
    write as it is; hexq export re-rounds a float-zero matrix onto the target's grid, as it does 1-bit ones).
    """

    bits: int = 8
    group_size: int | None = None  # None: one grid per output channel
    symmetric: bool = False  # 003 quantizes weights and activations asymmetrically
    method: str = "gptq"  # "gptq" | "rtn"
    act_order: str = "none"  # "none" | "max_activation" | "sum_of_squares"
    damp: float = 0.01  # fraction of mean(diag H) added to diag H; escalated x10 when Cholesky fails
    block_size: int = 128  # columns per lazy-update block
    fit_bits: tuple[int, ...] = ()  # gptq only: widths whose grids are fitted (hexq.algos.clipping)
    refit_bits: tuple[int, ...] = ()  # gptq only: widths whose grids are refitted to GPTQ's codes (hexq.algos.refit)
    clip_bits: tuple[int, ...] = ()  # gptq only: widths whose rows take the best of narrowed ranges (hexq.algos.gptq)
    one_bit: str = "minmax"  # "minmax" | "spread": the levels of an asymmetric 1-bit grid
    float_zero_bits: tuple[int, ...] = ()  # asymmetric only: widths whose grids span [min, max], float zero point

    def __post_init__(self) -> None:
        check_types(self)
        check_bits("bits", self.bits)
        check_choice("one_bit", self.one_bit, ONE_BIT_GRIDS)
        check_width_list("fit_bits", self.fit_bits)
        check_width_list("refit_bits", self.refit_bits)
        check_width_list("clip_bits", self.clip_bits)
        check_width_list("float_zero_bits", self.float_zero_bits)
        if self.float_zero_bits and self.symmetric:
            raise RecipeError("float_zero_bits", "is for asymmetric grids (symmetric: false)")
        if 1 in self.float_zero_bits:
            raise RecipeError("float_zero_bits", "lists 1: the 1-bit grid's zero point is a float already (one_bit)")
        if self.group_size is not None:
            check_at_least("group_size", self.group_size, 1)
        check_choice("method", self.method, WEIGHT_METHODS)
        check_choice("act_order", self.act_order, ACT_ORDERS)
        check_unit("damp", self.damp, open_low=True)
        check_at_least("block_size", self.block_size, 1)
        check_unused_at_default(self, "method", {name: ("gptq",) for name in ("act_order", "damp", "block_size",
                                                                                "fit_bits", "refit_bits",
                                                                                "clip_bits")})

    def spec(self, bits: int | None = None) -> QuantSpec:
        """The QuantSpec of this setting, at `bits` instead of self.bits when given (one replica of a bank)."""
        return QuantSpec(bits=self.bits if bits is None else bits, group_size=self.group_size,
                         symmetric=self.symmetric, one_bit=self.one_bit, float_zero_bits=self.float_zero_bits)


@dataclass(frozen=True)
class ActivationQuant:
    """How the inputs of quantized linears are quantized; bits None keeps them in full precision ("A16")."""

    bits: int | None = 8
    dynamic: bool = True  # True: per-token scales computed at run time; False: one static scale per tensor
    symmetric: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        if self.bits is not None:
            check_bits("bits", self.bits)
            return
        for f in fields(self):
            if f.name != "bits" and getattr(self, f.name) != f.default:
                raise RecipeError(f.name, "has no effect when bits is null (activations not quantized); remove it")

    @property
    def enabled(self) -> bool:
        return self.bits is not None


@dataclass(frozen=True)
class Smoothing:
    """Migration of activation outliers into the weights, s folded into the norm before each smoothing group.

    haq: grid search of e in [0, 1] with step grid_step for s = max|X|^e minimising ||Q(W s) Q(X/s) - W X||^2
    on at most max_tokens captured tokens per group (003 eq. 1-3); in the MoE group each routed expert is scored on
    the sampled tokens routed to it (moe_objective "routed") or on all of them ("all").
    smoothquant: s = max|X|^alpha / max|W|^(1-alpha).
    groups: which smoothing groups are smoothed ("attention": input norm -> q, k, v; "moe": post-attention norm ->
    router + experts + shared expert); stored in that canonical order.
    """

    method: str = "haq"  # "haq" | "smoothquant" | "none"
    alpha: float = 0.5  # smoothquant only
    grid_step: float = 0.05  # haq only
    max_tokens: int = 2048  # haq only
    groups: tuple[str, ...] = SMOOTHING_GROUPS
    moe_objective: str = "routed"  # haq only: "routed" (each expert on its tokens) | "all" (every expert, every token)

    def __post_init__(self) -> None:
        check_types(self)
        check_choice("method", self.method, SMOOTHING_METHODS)
        check_unit("alpha", self.alpha)
        check_unit("grid_step", self.grid_step, open_low=True)
        check_at_least("max_tokens", self.max_tokens, 1)
        self._check_groups()
        check_choice("moe_objective", self.moe_objective, MOE_OBJECTIVES)
        check_unused_at_default(self, "method", {"alpha": ("smoothquant",), "grid_step": ("haq",),
                                                  "max_tokens": ("haq",), "groups": ("haq", "smoothquant"),
                                                  "moe_objective": ("haq",)})

    def _check_groups(self) -> None:
        if not self.groups:
            raise RecipeError("groups", f"is empty; list at least one of {', '.join(SMOOTHING_GROUPS)} "
                                        "(or use method none)")
        for group in self.groups:
            check_choice("groups", group, SMOOTHING_GROUPS)
        if len(set(self.groups)) != len(self.groups):
            raise RecipeError("groups", f"lists a group twice: {list(self.groups)}")
        object.__setattr__(self, "groups", tuple(g for g in SMOOTHING_GROUPS if g in self.groups))


@dataclass(frozen=True)
class Experts:
    """How routed experts are quantized.

    uniform: every expert at one setting. replicas: a bank per expert, one GPTQ replica per replica_bits entry from
    one Hessian and one Cholesky factor, plus a loss table; the next layer's inputs are computed with the
    propagate_bits replica. weights / activations None: the recipe's top-level weights / activations sections;
    otherwise a complete WeightQuant / ActivationQuant (keys left out take the dataclass defaults, not the top-level
    values). In replicas mode weights.bits is unused (each replica has its own bits) and must stay at its default.

    loss_tokens (replicas only): the loss table measures each replica on at most this many of the expert's routed
    tokens (evenly strided): an MSE estimate needs a few thousand tokens, while its cost, a forward of the
    full-precision expert and of every replica, grows with the calibration set (at Mixtral-8x7B shapes and 128
    windows it would cost more than GPTQ itself). down_fit fits its maps on every routed token.

    export_target "vllm" (replicas only): also one GPTQ replica per expert on vLLM's fused-MoE W4A16 grid (4-bit
    symmetric, groups of 128, or 64/32 when 128 does not divide the expert widths) from the same Hessian and Cholesky
    factor, which `hexq pack` keeps and `hexq export --experts vllm` writes for every expert whose own replica is on
    another grid (hexq.calib.quantize.export_spec). export_target "gguf": also GPTQ replicas on llama.cpp's Q2_K and
    Q3_K grids (hexq.algos.kquant, hexq.calib.quantize.kquant_kinds), which `hexq pack --bank export` keeps for the
    layers `hexq export --format gguf` writes as K-quants.

    Cold experts: an expert with fewer than min_tokens routed calibration tokens uses H = (1 - fallback_blend) *
    H_expert + fallback_blend * H_layer (both per-token means; H_layer from every token reaching the MoE block); an
    expert with no routed token uses H_layer alone. It is quantized either way.

    round_bits: the widths whose GPTQ replicas then have their rounding and scales optimised on the expert's routed
    tokens (at most round_tokens of them, evenly strided) for round_steps signed-gradient steps (hexq.algos.rounding);
    cold experts keep GPTQ's. Costs round_steps forward and backward passes of the expert per width: on a CPU more
    than GPTQ itself. round_scope "block" optimises them instead against the full-precision model's output after the
    layer on every calibration batch, all routed experts at that width at once, with the layer's weight-only dense
    linears tuned alongside in the pass at propagate_bits (hexq.calib.block_rounding); it holds the layer's replicas
    at those widths in memory, carries the full-precision model's activations beside the quantized ones, and runs in
    one process. down_fit (replicas only): each width's down projection fitted to the full-precision intermediate
    ("full_precision", with one Hessian for every width) or to the one that width's gate_up replica produces
    ("replica", hexq.calib.down_fit).

    token_weights: a routed token counts in its expert's Hessians, down fit, loss table and round_bits objective
    "equal"ly or by its squared "routing" weight (hexq.model.simulate.RoutedTokens.scales): the layer adds w_t y_t,
    so the latter measures the expert's share of the layer output's error.
    """

    mode: str = "uniform"  # "uniform" | "replicas"
    replica_bits: tuple[int, ...] = (1, 2, 3, 4, 8)  # replicas only
    propagate_bits: int = 4  # replicas only
    weights: WeightQuant | None = None
    activations: ActivationQuant | None = None
    min_tokens: int = 16
    fallback_blend: float = 0.5
    export_target: str | None = None  # replicas only: "vllm" | "gguf"
    loss_tokens: int = 2048  # replicas only
    round_bits: tuple[int, ...] = ()  # widths whose rounding is optimised on routed tokens (hexq.algos.rounding)
    round_steps: int = 100
    round_tokens: int = 512
    round_scope: str = "expert"  # "expert" | "block" (hexq.calib.block_rounding)
    down_fit: str = "full_precision"  # replicas only: "full_precision" | "replica" (hexq.calib.down_fit)
    token_weights: str = "equal"  # "equal" | "routing": how an expert's routed tokens weigh in its Hessians and losses

    @property
    def routing_weighted(self) -> bool:
        """Whether a routed token counts by its squared routing weight (token_weights "routing")."""
        return self.token_weights == "routing"

    def __post_init__(self) -> None:
        check_types(self)
        check_choice("mode", self.mode, EXPERT_MODES)
        if self.export_target is not None:
            check_choice("export_target", self.export_target, EXPORT_TARGETS)
        self._check_replica_bits()
        check_at_least("min_tokens", self.min_tokens, 1)
        check_unit("fallback_blend", self.fallback_blend)
        check_at_least("loss_tokens", self.loss_tokens, 1)
        check_width_list("round_bits", self.round_bits)
        check_at_least("round_steps", self.round_steps, 1)
        check_at_least("round_tokens", self.round_tokens, 1)
        check_choice("round_scope", self.round_scope, ROUND_SCOPES)
        check_choice("down_fit", self.down_fit, DOWN_FITS)
        check_choice("token_weights", self.token_weights, TOKEN_WEIGHTS)
        for name in ("round_steps", "round_tokens", "round_scope") if not self.round_bits else ():
            if getattr(self, name) != getattr(Experts, name):
                raise RecipeError(name, "is used only with round_bits; remove it")
        if self.round_scope == "block" and self.round_tokens != Experts.round_tokens:
            raise RecipeError("round_tokens", "is not used with round_scope block (it tunes on every calibration "
                                              "batch); remove it")
        check_unused_at_default(self, "mode", {name: ("replicas",) for name in (
            "replica_bits", "propagate_bits", "export_target", "loss_tokens", "down_fit")})
        if self.mode == "replicas" and self.weights is not None and self.weights.bits != WeightQuant.bits:
            raise RecipeError("weights.bits", f"is not used in mode 'replicas' (each replica takes one of "
                                              f"replica_bits {list(self.replica_bits)}); remove it")

    def _check_replica_bits(self) -> None:
        bits = self.replica_bits
        if not bits:
            raise RecipeError("replica_bits", "is empty; list the replica widths, e.g. [1, 2, 3, 4, 8]")
        for b in bits:
            check_bits("replica_bits", b)
        if len(set(bits)) != len(bits):
            raise RecipeError("replica_bits", f"has duplicates: {list(bits)}")
        if list(bits) != sorted(bits):
            raise RecipeError("replica_bits", f"must be in increasing order, got {list(bits)}")
        if self.propagate_bits not in bits:
            raise RecipeError("propagate_bits", f"must be one of replica_bits {list(bits)}, got {self.propagate_bits}")


@dataclass(frozen=True)
class Calibration:
    """Calibration windows: num_samples windows of seqlen tokens drawn with seed."""

    num_samples: int = 128
    seqlen: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        check_at_least("num_samples", self.num_samples, 1)
        check_at_least("seqlen", self.seqlen, 1)
        check_at_least("seed", self.seed, 0)


@dataclass(frozen=True)
class Pack:
    """How `hexq pack` turns a calibration into an artifact; not part of the calibration's fingerprint.

    Importance S = alpha*norm(P) + (1 - alpha)*norm(W) from the calibration's router counts P and score sums W
    (002 §4.1). The allocation gives each expert one of `widths` (a subset of the calibration's replica widths; 0 skips
    the expert, 004's "4/0") minimising the loss table's summed MSE, with widths non-increasing in importance order
    (002 §4.2 prefix-split), under avg_bits per layer unless the command line gives a byte budget; a byte budget is
    split across layers by `schedule` (cosine: r(l) = (1-cosine_lambda)(cos(pi l/(L-1))+1)/2 + cosine_lambda);
    schedule "model" does not split either budget: avg_bits is the model's average, and the layers whose loss tables
    lose more at low width get more of it.
    `placement` picks hot_fraction of each layer's experts for the fast tier (003 Algorithm 2).
    loss: what the allocation minimises, the loss table's per-expert MSE ("expert", 002 §4.2) or each expert's MSE
    times its squared routing mass per layer token ("layer": the layer output's MSE, so a rarely routed expert
    weighs little). order: widths non-increasing in importance order ("importance", 002's prefix split) or any
    width per expert ("free", an exact multiple-choice knapsack; hexq.algos.allocation.allocate_free).
    export_replicas: also keep, for every expert whose allocated width has no exact 4-bit form (8 bits, 1-bit
    asymmetric), its 4-bit replica, which `hexq export` writes in that expert's place in a 4-bit layer (the same as
    `hexq pack --bank export`).
    """

    alpha: float = 0.5
    widths: tuple[int, ...] = (1, 2, 3, 4)
    avg_bits: float = 3.0
    schedule: str = "uniform"
    cosine_lambda: float = 0.5
    placement: str = "two_stage"
    hot_fraction: float = 0.25
    export_replicas: bool = False
    loss: str = "expert"
    order: str = "importance"

    def __post_init__(self) -> None:
        check_types(self)
        check_unit("alpha", self.alpha)
        if not self.widths:
            raise RecipeError("widths", "is empty; list the widths the allocation may use, e.g. [1, 2, 3, 4]")
        for b in self.widths:
            if not 0 <= b <= 8:
                raise RecipeError("widths", f"must be in 0..8 (0 skips the expert), got {b}")
        if list(self.widths) != sorted(set(self.widths)):
            raise RecipeError("widths", f"must be increasing without duplicates, got {list(self.widths)}")
        if not min(self.widths) <= self.avg_bits <= max(self.widths):
            raise RecipeError("avg_bits", f"must be within widths [{min(self.widths)}, {max(self.widths)}], "
                                          f"got {self.avg_bits}")
        check_choice("schedule", self.schedule, BUDGET_SCHEDULES)
        check_unit("cosine_lambda", self.cosine_lambda)
        check_choice("placement", self.placement, PLACEMENT_SCHEMES)
        check_unit("hot_fraction", self.hot_fraction, open_low=True)
        check_choice("loss", self.loss, PACK_LOSSES)
        check_choice("order", self.order, PACK_ORDERS)
        if self.schedule == "model" and self.order != "free":
            raise RecipeError("schedule", "'model' allocates any width per expert across layers: it needs order: free")


@dataclass(frozen=True)
class Recipe:
    """Everything `hexq calibrate` and `hexq pack` need besides the model and the text. weights / activations
    apply to attention and the shared expert (and to the routed experts unless `experts` overrides them).

    head: the LM head quantized weight-only (its input, the final norm's output, stays in full precision), by GPTQ on
    the final norm's outputs over the calibration windows or by RTN, e.g. {bits: 8} (per channel) or {bits: 4,
    group_size: 32}; None keeps it as the checkpoint stores it. A decode step reads the whole head once per token:
    at Qwen3-30B-A3B's vocabulary (151,936 x 2048) a bf16 head is 622 MB per token, more than everything else a
    3-bit step reads. A tied head (tie_word_embeddings) is quantized as a copy of its own; the embeddings stay."""

    name: str
    version: int = RECIPE_VERSION
    smoothing: Smoothing = field(default_factory=Smoothing)
    weights: WeightQuant = field(default_factory=WeightQuant)
    activations: ActivationQuant = field(default_factory=ActivationQuant)
    experts: Experts = field(default_factory=Experts)
    calibration: Calibration = field(default_factory=Calibration)
    pack: Pack = field(default_factory=Pack)
    head: WeightQuant | None = None

    def __post_init__(self) -> None:
        check_types(self)
        if not self.name.strip():
            raise RecipeError("name", "must not be empty")
        widths = self.experts.replica_bits if self.experts.mode == "replicas" else (self.expert_weights.bits,)
        lists = ("fit_bits", "float_zero_bits", "refit_bits", "clip_bits")  # WeightQuant's lists of widths
        named = [(f"weights.{key}", getattr(self.weights, key), (self.weights.bits,)) for key in lists]
        named += [(f"experts.weights.{key}", getattr(self.expert_weights, key), widths) for key in lists]
        named += [("experts.round_bits", self.experts.round_bits, widths)]
        if self.head is not None:
            named += [(f"head.{key}", getattr(self.head, key), (self.head.bits,)) for key in lists]
        if self.experts.weights is None:  # the top-level weights serve the experts too: either use is fine
            named = [(f"weights.{key}", getattr(self.weights, key), (self.weights.bits, *widths)) for key in lists] \
                + named[2 * len(lists):]
        for key, bits, allowed in named:
            unused = [b for b in bits if b not in allowed]
            if unused:
                raise RecipeError(key, f"lists {unused}, widths this recipe does not quantize (it quantizes "
                                       f"{sorted(set(allowed))}); remove them")
        if self.version != RECIPE_VERSION:
            raise RecipeError("version", f"{self.version} is not supported; this hexq reads recipe version "
                                         f"{RECIPE_VERSION}")

    @property
    def expert_weights(self) -> WeightQuant:
        return self.experts.weights or self.weights

    @property
    def expert_activations(self) -> ActivationQuant:
        return self.experts.activations or self.activations


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """A Recipe from its dict form (a parsed YAML file or `recipe_to_dict` output), with every check applied; a
    dict of an earlier recipe version is read as that version spelled it (_upgrade)."""
    return build(Recipe, _upgrade(data) if isinstance(data, Mapping) else data, "")


def _upgrade(data: Mapping[str, Any]) -> dict[str, Any]:
    """Version 1 named the allocation's widths pack.bits (beside pack.avg_bits, an average): the same recipe in
    version 2's spelling. Calibrations and artifacts written before keep their recipes readable."""
    data = dict(data)
    if data.get("version") == 1:
        data["version"] = RECIPE_VERSION
        pack = data.get("pack")
        if isinstance(pack, Mapping) and "bits" in pack:
            data["pack"] = {("widths" if key == "bits" else key): value for key, value in pack.items()}
    return data


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Every field, JSON/YAML-ready (tuples as lists); recipe_from_dict(recipe_to_dict(r)) == r."""
    return to_plain(recipe)
