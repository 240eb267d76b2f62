"""Precision policies: which width each routed (token, slot) runs at, chosen by name (`make_policy`).

The runtime's MoE experts module calls `choose(layer, indices, scores, prefill)` once per layer per forward pass
with that layer's routing ([T, k] expert ids and routing weights) and gets back [T, k] widths: one of the
artifact's replica widths (`table_bits`), or 0 to skip the slot. `transitions()` hands over the (layer, expert,
bits) loads the policy wants done in the background (prefetches); it is drained on every call.

  static   the artifact's allocation, allocation[layer][expert], for every slot.
  context  paper 002 Algorithm 1 lines 9-22, once per sequence. The prefill runs at the static allocation while
           the prompt's per-layer counts P and routing-score sums W are gathered; at end_prefill
           S = alpha P~ + (1 - alpha) W~ (hexq.algos.importance) ranks the experts, the top-K go to the highest
           allowed width and the rest are prefix-split under what is left of the layer's average-bit budget
           (hexq.algos.allocation.allocate, exact). The plan is fixed for the decode.
  online   paper 001 §3.5: a hotness EMA per layer, h <- beta h + (1 - beta) c, with c the routed counts of the
           last `interval` tokens; a per-layer set of K experts runs at high_bits and the rest at low_bits. An
           outside expert replaces the weakest member only when it is hotter by a relative margin (hysteresis),
           and every change is queued as a transition for the cache's budget tracker to admit.
  depth    paper 004 §4.2-4.3: per token, its slots ranked by routing score; layer l keeps the top
           ceil(r(l) k) slots (at least one) at high_bits and the rest at low_bits (2, or 0 = skip), with the
           cosine retention r(l) = (1 - lam)(cos(pi l / (L-1)) + 1) / 2 + lam.

Choices the papers leave open, and known gaps:
  - context widths. The replanning may use every width the allocation uses plus every replica width up to the
    allocation's highest (table_bits (1, 2, 3, 4, 8) with a 2-4 bit allocation gives {1, 2, 3, 4}); 0 (skip) only
    if the allocation already skips experts. Capping at the highest width keeps the cache sized for the plan. The
    K hot experts are charged to the same layer budget, floor(avg_bits * E) bits, because hexq has one memory pool
    where 002 has GPU and NDP pools; if K experts at the top width do not leave enough for the rest, K shrinks
    until the plan fits. Experts the prompt never routed to tie at S = 0 and keep the artifact's ranking (its
    widths, then expert id). Only promotions (a width above the static one) are reported as transitions: a
    lower-width ask is served by a resident higher-width copy.
  - online budget. The high-precision capacity is K = max(1, round(hot_fraction * E)) per layer (001's C_l); the
    layer average is (K high_bits + (E - K) low_bits) / E, not avg_bits. The hysteresis margin is relative:
    h_out > (1 + margin) h_weakest, scale-free like the EMA itself (001 allows an additive threshold or a rank
    slack). The interval counts tokens seen by the layer, not wall time as in 001, so runs are reproducible.
    Hotness persists across sequences (001 tracks long-horizon traffic); it starts at 0 with the hot set taken
    from the allocation (the experts it gives the highest widths).
  - Non-blocking widths. `online` decides a call's widths before counting that call's tokens, so a promotion
    takes effect from the next forward pass, after the background load had a chance to run.
  - depth prefill (gap). 004 ranks prefill experts by heavy-hitter tokens, the tokens with the largest mean
    attention. The runtime does not expose attention probabilities, so prefill ranks slots by routing score
    like the decode (004 eq. 3).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from hexq.algos.allocation import allocate, avg_bit_budget, cosine_retention, loss_columns
from hexq.algos.importance import importance
from hexq.algos.policy_widths import (
    DEPTH_LOW_BITS,
    POLICIES,
    context_bits,
    depth_high_bits,
    online_widths,
    used_widths,
)
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError

Transition = tuple[int, int, int]  # (layer, expert, bits)


@dataclass(frozen=True)
class PolicyContext:
    """Facts from the artifact every policy may use."""

    allocation: list[list[int]]  # [L][E] widths of the artifact's default plan (0 = skipped)
    loss_table: torch.Tensor  # [L, E, len(table_bits)] output MSE of each replica width
    skip_loss: torch.Tensor  # [L, E] output MSE of skipping the expert
    table_bits: tuple[int, ...]  # widths of loss_table's columns, ascending
    avg_bits: float  # average-bit budget per layer
    hot_fraction: float  # share of each layer's experts kept at high precision
    top_k: int  # routed slots per token

    def __post_init__(self) -> None:
        L, E = len(self.allocation), len(self.allocation[0]) if self.allocation else 0
        if L == 0 or E == 0 or any(len(row) != E for row in self.allocation):
            raise ValueError("allocation must be a non-empty [layers][experts] table of widths")
        bits = list(self.table_bits)
        if not bits or bits[0] <= 0 or bits != sorted(set(bits)):
            raise ValueError(f"table_bits must be positive and strictly ascending, got {bits}")
        unknown = sorted({b for row in self.allocation for b in row} - {0, *bits})
        if unknown:
            raise ValueError(f"allocation uses widths {unknown} that have no column in table_bits {bits}")
        if tuple(self.loss_table.shape) != (L, E, len(bits)):
            raise ValueError(f"loss_table must have shape {(L, E, len(bits))}, got {tuple(self.loss_table.shape)}")
        if tuple(self.skip_loss.shape) != (L, E):
            raise ValueError(f"skip_loss must have shape {(L, E)}, got {tuple(self.skip_loss.shape)}")
        if not 0.0 < self.hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in (0, 1], got {self.hot_fraction}")
        if not 1 <= self.top_k <= E:
            raise ValueError(f"top_k must be in 1..{E} (the number of experts), got {self.top_k}")

    @property
    def num_layers(self) -> int:
        return len(self.allocation)

    @property
    def num_experts(self) -> int:
        return len(self.allocation[0])

    @property
    def hot_experts(self) -> int:
        """K, the high-precision experts per layer (rounded as `hexq pack` rounds its placement)."""
        return max(1, round(self.hot_fraction * self.num_experts))

    @property
    def used_bits(self) -> list[int]:
        """Widths the allocation uses, ascending (0 if it skips experts)."""
        return used_widths(self.allocation)

    def loss_columns(self, layer: int, bits: list[int]) -> torch.Tensor:
        """[E, len(bits)] losses of one layer restricted to `bits` (0 = the loss of skipping), float64."""
        return loss_columns(self.loss_table[layer], self.skip_loss[layer], self.table_bits, bits)


class PrecisionPolicy(Protocol):
    name: str

    def begin_sequence(self) -> None: ...

    def end_prefill(self) -> None: ...

    def choose(self, layer: int, indices: torch.Tensor, scores: torch.Tensor, prefill: bool) -> torch.Tensor: ...

    def transitions(self) -> list[Transition]: ...


class _Policy:
    """No per-sequence state and nothing to prefetch unless a policy says otherwise."""

    name = ""

    def __init__(self, context: PolicyContext):
        self.context = context

    def begin_sequence(self) -> None:
        pass

    def end_prefill(self) -> None:
        pass

    def transitions(self) -> list[Transition]:
        return []

    def widths(self) -> set[int]:
        """Widths this policy may ask any expert for besides its allocated one (0 = skip needs no replica): what
        an artifact must store for every expert (`hexq pack --bank`)."""
        return set()

    def _check_routing(self, layer: int, indices: torch.Tensor, scores: torch.Tensor) -> None:
        if not 0 <= layer < self.context.num_layers:
            raise ValueError(f"layer {layer} is out of range 0..{self.context.num_layers - 1}")
        if indices.ndim != 2 or indices.shape != scores.shape:
            raise ValueError(f"indices and scores must both be [tokens, k]; got {tuple(indices.shape)} and "
                             f"{tuple(scores.shape)}")

    def _width(self, bits: int | None, default: int, option: str, allow_skip: bool = False) -> int:
        """A width option: `default` when unset, else one of table_bits (or 0 when skipping is allowed)."""
        bits = default if bits is None else int(bits)
        allowed = ([0] if allow_skip else []) + list(self.context.table_bits)
        if bits not in allowed:
            raise ValueError(f"{option}={bits} has no replica; choose one of {allowed}")
        return bits


def _widths_by_expert(widths: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """widths [E] looked up at indices [T, k] on the routing's device."""
    return widths.to(indices.device)[indices]


def highest_width_experts(allocation_row: list[int], count: int) -> list[int]:
    """The `count` experts the allocation gives the highest widths (ties: lower expert id first)."""
    return sorted(range(len(allocation_row)), key=lambda e: (-allocation_row[e], e))[:count]


# ------------------------------------------------------------------------------------------ static


class StaticPolicy(_Policy):
    name = "static"

    def __init__(self, context: PolicyContext):
        super().__init__(context)
        self._widths = torch.tensor(context.allocation, dtype=torch.long, device="cpu")

    def choose(self, layer: int, indices: torch.Tensor, scores: torch.Tensor, prefill: bool) -> torch.Tensor:
        self._check_routing(layer, indices, scores)
        return _widths_by_expert(self._widths[layer], indices)


# ------------------------------------------------------------------------------------------ context (002)


def context_widths(S: torch.Tensor, static_row: list[int], loss: torch.Tensor, bits: list[int], avg_bits: float,
                   hot: int) -> list[int]:
    """One layer's widths by expert id after a prefill (002 Algorithm 1 lines 12-22).

    S [E]: the prompt's importance; loss [E, len(bits)]: the loss of each expert at each allowed width. The `hot`
    most important experts get bits[-1]; the rest are prefix-split exactly under the remaining budget of
    floor(avg_bits * E) bits. Ties in S keep the static ranking (static width, then id).
    """
    E = len(static_row)
    order = sorted(range(E), key=lambda e: (-float(S[e]), -static_row[e], e))
    budget = avg_bit_budget(avg_bits, E)
    # Fewer hot experts when K at the top width would leave the others below the lowest width.
    while hot > 0 and budget - hot * bits[-1] < (E - hot) * bits[0]:
        hot -= 1
    rest = order[hot:]
    rest_widths = allocate(loss[rest], bits, list(range(len(rest))), costs=bits, budget=budget - hot * bits[-1])
    widths = [0] * E
    for expert in order[:hot]:
        widths[expert] = bits[-1]
    for expert, width in zip(rest, rest_widths, strict=True):
        widths[expert] = width
    return widths


class ContextPolicy(_Policy):
    """Re-plans each layer once per sequence from the prompt's routing statistics (002)."""

    name = "context"

    def __init__(self, context: PolicyContext, alpha: float = 0.5, bits: tuple[int, ...] | None = None):
        super().__init__(context)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self.bits = self._allowed_bits() if bits is None else sorted({self._width(b, b, "bits", True) for b in bits})
        if not self.bits or avg_bit_budget(context.avg_bits, context.num_experts) < context.num_experts * self.bits[0]:
            raise ValueError(f"avg_bits={context.avg_bits} is below the lowest allowed width of {self.bits}")
        self._static = torch.tensor(context.allocation, dtype=torch.long, device="cpu")
        self.begin_sequence()

    def _allowed_bits(self) -> list[int]:
        return context_bits(self.context.used_bits, self.context.table_bits)

    def begin_sequence(self) -> None:
        shape = (self.context.num_layers, self.context.num_experts)
        self._counts = torch.zeros(shape, dtype=torch.float64, device="cpu")
        self._score_sums = torch.zeros(shape, dtype=torch.float64, device="cpu")
        self._plan: torch.Tensor | None = None  # [L, E] widths for the decode, set by end_prefill
        self._pending: list[Transition] = []

    def end_prefill(self) -> None:
        ctx = self.context
        S = importance(self._counts, self._score_sums, self.alpha)
        plan = self._static.clone()
        for layer in range(ctx.num_layers):
            if self._counts[layer].sum() == 0:
                continue  # the prompt told nothing about this layer: keep the artifact's plan
            loss = ctx.loss_columns(layer, self.bits)
            widths = context_widths(S[layer], ctx.allocation[layer], loss, self.bits, ctx.avg_bits, ctx.hot_experts)
            plan[layer] = torch.tensor(widths, device="cpu")
        self._plan = plan
        promoted = (plan > self._static).nonzero().tolist()
        self._pending = [(layer, expert, int(plan[layer, expert])) for layer, expert in promoted]

    def choose(self, layer: int, indices: torch.Tensor, scores: torch.Tensor, prefill: bool) -> torch.Tensor:
        self._check_routing(layer, indices, scores)
        if prefill:
            flat = indices.detach().reshape(-1).cpu()
            self._counts[layer] += torch.bincount(flat, minlength=self.context.num_experts).double()
            self._score_sums[layer].index_add_(0, flat, scores.detach().reshape(-1).cpu().double())
        plan = self._static if self._plan is None else self._plan
        return _widths_by_expert(plan[layer], indices)

    def transitions(self) -> list[Transition]:
        pending, self._pending = self._pending, []
        return pending

    def widths(self) -> set[int]:
        return set(self.bits) - {0}


# ------------------------------------------------------------------------------------------ online (001)


class OnlinePolicy(_Policy):
    """Per-layer hot sets that follow a hotness EMA, with hysteresis against churn (001)."""

    name = "online"

    def __init__(self, context: PolicyContext, interval: int = 16, beta: float = 0.8, margin: float = 0.1,
                 high_bits: int | None = None, low_bits: int | None = None):
        super().__init__(context)
        if interval < 1:
            raise ValueError(f"interval must be >= 1 token, got {interval}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0 (relative hysteresis), got {margin}")
        high, low = online_widths(context.used_bits, context.table_bits)
        self.high_bits = self._width(high_bits, high, "high_bits")
        self.low_bits = self._width(low_bits, low, "low_bits", allow_skip=True)
        if self.low_bits > self.high_bits:
            raise ValueError(f"low_bits={self.low_bits} is above high_bits={self.high_bits}")
        self.interval, self.beta, self.margin = interval, beta, margin
        L, E = context.num_layers, context.num_experts
        self.hotness = torch.zeros(L, E, dtype=torch.float64, device="cpu")
        # routed (token, slot) pairs of the open interval
        self._counts = torch.zeros(L, E, dtype=torch.float64, device="cpu")
        self._tokens = [0] * L  # tokens in the open interval
        self.hot = torch.zeros(L, E, dtype=torch.bool, device="cpu")
        for layer, row in enumerate(context.allocation):
            self.hot[layer, highest_width_experts(row, context.hot_experts)] = True
        self._queue: dict[tuple[int, int], int] = {}  # (layer, expert) -> bits; a later change replaces an earlier

    def choose(self, layer: int, indices: torch.Tensor, scores: torch.Tensor, prefill: bool) -> torch.Tensor:
        self._check_routing(layer, indices, scores)
        widths = torch.where(self.hot[layer], self.high_bits, self.low_bits)
        out = _widths_by_expert(widths, indices)  # decided before this call's tokens move the hot set
        self._observe(layer, indices.detach().cpu())
        return out

    def _observe(self, layer: int, indices: torch.Tensor) -> None:
        """Count the tokens interval by interval, so a long prefill makes one EMA step per `interval` tokens."""
        E = self.context.num_experts
        per_token = torch.zeros(indices.shape[0], E, dtype=torch.float64, device=indices.device)
        per_token.scatter_add_(1, indices, torch.ones_like(indices, dtype=torch.float64))
        start = 0
        while start < len(per_token):
            take = min(len(per_token) - start, self.interval - self._tokens[layer])
            self._counts[layer] += per_token[start:start + take].sum(dim=0)
            self._tokens[layer] += take
            start += take
            if self._tokens[layer] == self.interval:
                self._close_interval(layer)

    def _close_interval(self, layer: int) -> None:
        self.hotness[layer] = self.beta * self.hotness[layer] + (1 - self.beta) * self._counts[layer]
        self._counts[layer].zero_()
        self._tokens[layer] = 0
        self._rebalance(layer)

    def _rebalance(self, layer: int) -> None:
        """Swap the hottest outsider for the weakest member while it beats it by the margin (001 hysteresis)."""
        h, hot = self.hotness[layer], self.hot[layer]
        inside, outside = hot.nonzero().flatten(), (~hot).nonzero().flatten()
        while len(outside):
            weakest = int(inside[h[inside].argmin()])
            hottest = int(outside[h[outside].argmax()])
            if h[hottest] <= (1 + self.margin) * h[weakest]:
                break
            hot[weakest], hot[hottest] = False, True
            self._queue.pop((layer, hottest), None)  # re-insert so the queue stays in decision order
            self._queue[(layer, hottest)] = self.high_bits
            self._queue.pop((layer, weakest), None)
            self._queue[(layer, weakest)] = self.low_bits
            inside, outside = hot.nonzero().flatten(), (~hot).nonzero().flatten()

    def transitions(self) -> list[Transition]:
        queued, self._queue = self._queue, {}
        return [(layer, expert, bits) for (layer, expert), bits in queued.items()]

    def widths(self) -> set[int]:
        return {self.high_bits, self.low_bits} - {0}


# ------------------------------------------------------------------------------------------ depth (004)


class DepthPolicy(_Policy):
    """Per token, its highest-scored slots at high_bits; fewer of them in deeper layers (004)."""

    name = "depth"

    def __init__(self, context: PolicyContext, lam: float = 0.5, high_bits: int | None = None,
                 low_bits: int = DEPTH_LOW_BITS):
        super().__init__(context)
        self.high_bits = self._width(high_bits, depth_high_bits(context.used_bits, context.table_bits), "high_bits")
        self.low_bits = self._width(low_bits, low_bits, "low_bits", allow_skip=True)
        if self.low_bits > self.high_bits:
            raise ValueError(f"low_bits={self.low_bits} is above high_bits={self.high_bits}")
        self.retention = cosine_retention(context.num_layers, lam)

    def kept_slots(self, layer: int, k: int) -> int:
        """t_l = ceil(r(l) k) (004 eq. 5), at least 1 and at most k; the slack absorbs float error in r * k."""
        return min(k, max(1, math.ceil(self.retention[layer] * k - 1e-9)))

    def choose(self, layer: int, indices: torch.Tensor, scores: torch.Tensor, prefill: bool) -> torch.Tensor:
        self._check_routing(layer, indices, scores)
        T, k = indices.shape
        # Rank of each slot within its token by routing score, highest first; equal scores keep slot order.
        order = torch.sort(scores.detach(), dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=order.device).expand(T, k))
        high = rank < self.kept_slots(layer, k)
        return torch.where(high, self.high_bits, self.low_bits).long()

    def widths(self) -> set[int]:
        return {self.high_bits, self.low_bits} - {0}


# ------------------------------------------------------------------------------------------ registry

_REGISTRY: dict[str, type[_Policy]] = {cls.name: cls for cls in (StaticPolicy, ContextPolicy, OnlinePolicy,
                                                                 DepthPolicy)}
# the names are hexq.algos.policy_widths.POLICIES (pack's --bank takes them too): one list, checked here
assert tuple(_REGISTRY) == POLICIES, (tuple(_REGISTRY), POLICIES)


def make_policy(name: str, context: PolicyContext, **options) -> PrecisionPolicy:
    """The policy called `name` (one of POLICIES) with its options (e.g. interval=8 for "online")."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown precision policy {name!r}; choose one of {', '.join(POLICIES)}")
    cls = _REGISTRY[name]
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "context")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for policy {name!r}; allowed: {allowed or 'none'}")
    return cls(context, **options)


def policy_context(artifact: Artifact, hot_fraction: float | None = None) -> PolicyContext:
    """The artifact's facts for the policies; hot_fraction overrides the pack recipe's."""
    stats = {key: artifact.tensor(STATS_SHARD, key) for key in ("loss_table", "loss_table.skip")}
    allocation = artifact.allocation
    return PolicyContext(allocation=allocation, loss_table=stats["loss_table"].float(),
                         skip_loss=stats["loss_table.skip"].float(), table_bits=tuple(artifact.replica_bits),
                         avg_bits=artifact.average_bits,
                         hot_fraction=hot_fraction or artifact.recipe.pack.hot_fraction,
                         top_k=artifact.top_k)


def check_policy_widths(artifact: Artifact, policy) -> None:
    """Every width the policy may ask for is stored for every expert, or a one-line error names the --bank."""
    needed = policy.widths()
    missing = sorted({b for b in needed for row in range(len(artifact.moe_layers))
                      for e in range(artifact.num_experts) if b not in artifact.stored_bits(row, e)})
    if missing:
        raise HexqError(f"policy {policy.name} needs every expert at {sorted(needed)} bits but {artifact.path} "
                        f"stores only the allocation plus {artifact.bank_bits or 'nothing'}; pack with "
                        f"--bank {policy.name} (or --bank {','.join(map(str, missing))})")
