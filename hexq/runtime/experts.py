"""One MoE layer's routed experts served from the ExpertCache: `CachedExperts`, the module that stands in for the
family's experts module (hexq.runtime.engine explains the whole runtime).

Per forward pass it receives (hidden_states, top_k_index, top_k_weights) from the family's own MoE block (the router
and shared expert stay the model's) and:
  1. asks the precision policy for the width of every (token, slot) (hexq.runtime.policy);
  2. look-ahead prefetch (004 §4.4.1): applies layer l+1's router to layer l's MoE input and queues the predicted
     experts of l+1 to the cache's background worker - in prefill the top-t experts by predicted token frequency,
     in decode the predicted top-k of the current token - so loading overlaps this layer's compute. The input is
     first re-weighted by w_{l+1} / w_l, the ratio of the two layers' post-attention norm weights: RMS
     normalisation is scale-free, so this is exactly what layer l+1's norm makes of the same residual stream
     (it misses only what layer l's experts and layer l+1's attention add);
  3. groups the routed tokens by (expert, width) with one sort (hexq.runtime.compute.route), pins the layer's
     experts, takes each from the cache (a miss that would evict is decided by the cost model: fill, or a
     transient load computed at once), highest width first so that lower-width requests reuse it (004 §4.4.2);
  4. computes them all through hexq.runtime.compute (two kernel calls for every expert computed from its codes)
     and adds each token's weighted outputs; a slot the policy gives 0 bits is skipped, its routing weight
     renormalised onto the token's kept experts (hexq.model.simulate.served_weights, as `hexq eval` computes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hexq.model.simulate import served_weights
from hexq.runtime.cache import ExpertCache
from hexq.runtime.compute import Compute, route
from hexq.runtime.cost import usage_update

# Tokens over which the per-expert usage estimates average (hexq.runtime.cost.usage_update). Short, so that the
# estimate follows the traffic's locality: decoding 3 x 64 tokens after 128-token prompts on the reference models at
# 25% and 50% of the experts' bytes, 16 gave the highest hit rates of 4, 16, 64 and 256 in 9 of 12 sequences, and
# beat plain LRU in 11 of 12 (mixtral 50%: 0.79 / 0.86 / 0.87 against LRU's 0.79 / 0.77 / 0.72).
USAGE_HORIZON = 16.0


@dataclass
class PrefetchStats:
    """Look-ahead quality: predicted experts of layer l+1 against the experts layer l+1 then used."""

    predicted: int = 0
    used: int = 0
    correct: int = 0

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.used if self.used else 0.0


@dataclass
class RunState:
    """Shared by every layer's CachedExperts: the phase, predictions in flight, usage estimates and counters."""

    prefill: bool = True
    prefetch: bool = True
    prefetch_top_t: int = 0  # experts predicted per layer ahead; 0: 2k capped at layer_share (see look_ahead)
    layer_share: int = 1  # experts the cache holds per layer: capacity // expert bytes // layers
    mode: str = "cache"
    predicted: dict[int, set[int]] = field(default_factory=dict)  # layer -> experts predicted by the layer below
    prefetch_stats: PrefetchStats = field(default_factory=PrefetchStats)
    last_bits: dict[tuple[int, int], int] = field(default_factory=dict)  # width each expert was last asked at
    skipped_slots: int = 0
    usage: torch.Tensor | None = None  # [L, E] float64 expected uses per token (hexq.runtime.cost), on the CPU


def most_routed(indices: torch.Tensor, num_experts: int, n: int) -> list[int]:
    """The (at most) n experts chosen most often in `indices` (any shape of expert ids), ties by expert id;
    ids outside [0, num_experts) (dropped slots) and experts never chosen are left out."""
    flat = indices.reshape(-1)
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)
    return [e for e in torch.argsort(counts, descending=True, stable=True)[:n].tolist() if counts[e]]


class CachedExperts(torch.nn.Module):
    """One layer's routed experts served from the ExpertCache (see the module docstring)."""

    def __init__(self, layer: int, num_experts: int, cache: ExpertCache, policy, state: RunState, act_fn,
                 quantizers, compute: Compute) -> None:
        super().__init__()
        self.layer, self.num_experts = layer, num_experts
        self.cache, self.policy, self.state = cache, policy, state
        self.act_fn = act_fn
        self.quantizers = quantizers  # (input, intermediate) activation quantizers of the recipe, or None
        self.compute = compute
        self.arena = None  # hexq.runtime.arena.ExpertArena when every expert lives on the GPU
        # look-ahead, set by Runtime once every layer exists (None in the last layer)
        self.next_router: torch.nn.Module | None = None  # layer l+1's router
        self.norm_ratio: torch.Tensor | None = None  # w_{l+1} / w_l of the post-attention norms
        self.default_bits_next: list[int] = []  # layer l+1's allocation

    def look_ahead(self, hidden_states: torch.Tensor) -> None:
        """Predict layer l+1's experts from layer l's MoE input and queue them (004 §4.4.1)."""
        state = self.state
        ahead = hidden_states if self.norm_ratio is None else hidden_states * self.norm_ratio
        logits, _scores, predicted = self.next_router(ahead)
        # One layer ahead, the router's own top-k finds ~57% of the experts the next layer uses on the reference
        # models and its top-2k ~80% (benchmarks/runtime.py reports precision and recall); but prefetching more
        # experts than a layer's share of the cache evicts what the next tokens will ask for, so the default is
        # 2k capped at that share.
        top_t = min(state.prefetch_top_t or min(2 * predicted.shape[-1], state.layer_share), self.num_experts)
        if state.prefill:  # top-t experts by predicted token frequency
            experts = most_routed(predicted, self.num_experts, top_t)
        else:  # decode: the current token's t most likely experts (t may exceed the router's k)
            experts = logits.reshape(-1, logits.shape[-1])[-1, : self.num_experts].topk(top_t).indices.tolist()
        layer = self.layer + 1
        state.predicted[layer] = set(experts)
        if state.mode == "cache":
            for expert in experts:
                bits = state.last_bits.get((layer, expert), 0) or self.default_bits_next[expert]
                if bits:
                    self.cache.prefetch(layer, expert, bits)

    def admitted(self, top_k_index: torch.Tensor) -> set[int]:
        """The experts whose misses may fill the cache in this forward pass; the others are computed from a
        transient load (the bypass) and evict nothing.

        A prompt touches most experts of every layer, so filling all of them would push the whole cache out once
        per layer - the cyclic scan that defeats LRU. In prefill only the layer's `layer_share` most-used experts
        are admitted (the cost-model idea of 003 §III.C.1: experts with few tokens are not worth a fill); in decode
        every expert is (and the per-miss cost model still decides).
        """
        if self.state.mode != "cache":
            return set()
        if not self.state.prefill:
            return set(range(self.num_experts))
        return set(most_routed(top_k_index, self.num_experts, self.state.layer_share))

    def observe(self, top_k_index: torch.Tensor) -> None:
        """Move this layer's usage estimates by the tokens just routed (the cost model's u)."""
        usage = self.state.usage
        if usage is None:
            return
        flat = top_k_index.reshape(-1).cpu()
        counts = torch.bincount(flat[(flat >= 0) & (flat < self.num_experts)], minlength=self.num_experts)
        usage[self.layer] = usage_update(usage[self.layer], counts, top_k_index.shape[0], USAGE_HORIZON)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.arena is not None:  # nothing to load, predict or count on the host: one launch per projection
            self.compute.counters.gemv_rows += top_k_index.numel()
            return self.arena(hidden_states, top_k_index, top_k_weights, self.act_fn, self.quantizers)
        state = self.state
        if self.layer in state.predicted:  # score the prediction the layer below made for this layer
            used = {e for e in top_k_index.unique().tolist() if 0 <= e < self.num_experts}
            predicted = state.predicted.pop(self.layer)
            state.prefetch_stats.predicted += len(predicted)
            state.prefetch_stats.used += len(used)
            state.prefetch_stats.correct += len(predicted & used)
        self.observe(top_k_index)
        bits = self.policy.choose(self.layer, top_k_index, top_k_weights, state.prefill)
        for layer, expert, b in self.policy.transitions():
            state.last_bits[(layer, expert)] = b
            if state.mode == "cache" and b:
                self.cache.prefetch(layer, expert, b)
        if state.prefetch and self.next_router is not None:
            self.look_ahead(hidden_states)
        plan = route(top_k_index, bits, self.num_experts)
        state.skipped_slots += plan.skipped
        x = hidden_states[plan.tokens]
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        admitted = self.admitted(top_k_index)
        experts = sorted({expert for expert, _, _, _ in plan.groups})
        with self.cache.pinned(self.layer, experts):
            batch = []
            for expert, width, start, count in plan.groups:
                state.last_bits[(self.layer, expert)] = width
                weights = self.cache.get(self.layer, expert, width, fill=expert in admitted)
                if self.compute.lays_out(weights):  # cached or transient, every expert is computed in one layout:
                    # the same numbers whatever is resident (a transient one is this thread's buffer, re-laid in place)
                    weights = (self.compute.relaid(weights) if weights.transient
                               else self.cache.relayout(self.layer, expert, self.compute.relaid))
                if weights.transient:  # the loading thread's buffer: computed before the next load reuses it
                    y[start:start + count] = self.compute.expert(x[start:start + count], weights, self.act_fn,
                                                                 self.quantizers)
                else:
                    batch.append((weights, start, count))
            self.compute.experts(x, batch, y, self.act_fn, self.quantizers)
        # the weighted sum in float32, in place (a prefill pass of 256 tokens holds its routed rows' outputs,
        # 16 MiB on a Qwen3-30B-A3B shape, once; hexq.runtime.memory.prefill_scratch_nbytes counts them)
        weights = served_weights(top_k_index, top_k_weights, bits > 0, self.num_experts)
        y.mul_(weights[plan.tokens, plan.slots, None])
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        return out.index_add_(0, plan.tokens, y).to(hidden_states.dtype)
