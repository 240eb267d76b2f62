"""`hexq run`: an artifact served under a hard memory budget for its routed experts.

The model is built from the artifact (hexq.runtime.model) with one replacement for every layer's routed-experts
module, `CachedExperts`. The family's own MoE block still runs its router and shared expert, so routing is exactly
the model's; CachedExperts receives (hidden_states, top_k_index, top_k_weights) and, per forward pass:

  1. asks the precision policy for the width of every (token, slot) (hexq.runtime.policy);
  2. look-ahead prefetch (004 §4.4.1): applies layer l+1's router to layer l's MoE input and queues the predicted
     experts of l+1 to the cache's background worker - in prefill the top-t experts by predicted token frequency,
     in decode the predicted top-k of the current token - so loading overlaps this layer's compute. The input is
     first re-weighted by w_{l+1} / w_l, the ratio of the two layers' post-attention norm weights: RMS
     normalisation is scale-free, so this is exactly what layer l+1's norm makes of the same residual stream
     (it misses only what layer l's experts and layer l+1's attention add);
  3. computes each expert from the cache (ExpertCache: budgeted mixed-precision LRU, versioned handles), pinning
     it while it computes, highest requested width first so lower-width requests reuse it (004 §4.4.2).

The fast tier holds compute-ready (dequantized) weights: on CPU float32 tensors in RAM, with the packed artifact
(mmap) as the slow tier; on CUDA the same tensors in device memory. Every expert dequantizes to the same number of
bytes whatever its width, so on this runtime a lower width changes quality and load work, not cache capacity.

Correctness: with the `static` policy the result of every forward pass is bit-identical for every budget and
equals the model with all experts resident (hexq.runtime.model.resident_experts): the experts are visited in the
same ascending order and computed by the same function (hexq.simulate.quantized_expert_output).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hexq.adapters import adapter_for
from hexq.artifact.format import STATS_SHARD, Artifact
from hexq.devices import resolve_device
from hexq.errors import HexqError
from hexq.runtime.cache import CacheStats, ExpertCache, ExpertWeights
from hexq.runtime.model import build_model, expert_quantizers
from hexq.runtime.policy import PolicyContext, make_policy
from hexq.simulate import quantized_expert_output

MODES = ("cache", "ondemand")  # ondemand: no fast tier, every expert loaded from the slow tier at each use


class ArtifactSource:
    """The slow tier: one expert at one width, read from the artifact, unpacked and dequantized on `device`.
    Layers are MoE rows (the artifact's allocation rows), as everywhere in the runtime."""

    def __init__(self, artifact: Artifact, dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        self.artifact, self.dtype, self.device = artifact, dtype, device or torch.device("cpu")
        shapes = [artifact.expert_shape(p) for p in ("gate_up", "down")]
        self.expert_nbytes = sum(rows * cols for rows, cols in shapes) * torch.finfo(dtype).bits // 8

    def nbytes(self, layer: int, expert: int, bits: int) -> int:
        return self.expert_nbytes

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        gate_up, down = self.artifact.expert_weights(layer, expert, bits, self.dtype)
        return ExpertWeights(bits, gate_up.to(self.device), down.to(self.device))


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
    """Shared by every layer's CachedExperts: the phase, predictions in flight and counters."""

    prefill: bool = True
    prefetch: bool = True
    prefetch_top_t: int = 0  # experts predicted per layer ahead; 0: 2k capped at layer_share (see look_ahead)
    layer_share: int = 1  # experts the cache holds per layer: capacity // expert bytes // layers
    mode: str = "cache"
    predicted: dict[int, set[int]] = field(default_factory=dict)  # layer -> experts predicted by the layer below
    prefetch_stats: PrefetchStats = field(default_factory=PrefetchStats)
    last_bits: dict[tuple[int, int], int] = field(default_factory=dict)  # width each expert was last asked at
    skipped_slots: int = 0


def most_routed(indices: torch.Tensor, num_experts: int, n: int) -> list[int]:
    """The (at most) n experts chosen most often in `indices` (any shape of expert ids), ties by expert id;
    ids outside [0, num_experts) (dropped slots) and experts never chosen are left out."""
    flat = indices.reshape(-1)
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)
    return [e for e in torch.argsort(counts, descending=True, stable=True)[:n].tolist() if counts[e]]


class CachedExperts(torch.nn.Module):
    """One layer's routed experts served from the ExpertCache (see the module docstring)."""

    def __init__(self, layer: int, num_experts: int, cache: ExpertCache, policy, state: RunState, act_fn,
                 quantizers) -> None:
        super().__init__()
        self.layer, self.num_experts = layer, num_experts
        self.cache, self.policy, self.state = cache, policy, state
        self.act_fn = act_fn
        self.input_quant, self.mid_quant = quantizers
        # look-ahead, set by Runtime once every layer exists (None in the last layer)
        self.next_router: torch.nn.Module | None = None  # layer l+1's router
        self.norm_ratio: torch.Tensor | None = None  # w_{l+1} / w_l of the post-attention norms
        self.default_bits_next: list[int] = []  # layer l+1's allocation

    def expert_forward(self, weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
        return quantized_expert_output(x, weights.gate_up, weights.down, self.act_fn, self.input_quant,
                                       self.mid_quant)

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
        every expert is.
        """
        if self.state.mode != "cache":
            return set()
        if not self.state.prefill:
            return set(range(self.num_experts))
        return set(most_routed(top_k_index, self.num_experts, self.state.layer_share))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        state = self.state
        if self.layer in state.predicted:  # score the prediction the layer below made for this layer
            used = {e for e in top_k_index.unique().tolist() if 0 <= e < self.num_experts}
            predicted = state.predicted.pop(self.layer)
            state.prefetch_stats.predicted += len(predicted)
            state.prefetch_stats.used += len(used)
            state.prefetch_stats.correct += len(predicted & used)
        bits = self.policy.choose(self.layer, top_k_index, top_k_weights, state.prefill)
        for layer, expert, b in self.policy.transitions():
            state.last_bits[(layer, expert)] = b
            if state.mode == "cache" and b:
                self.cache.prefetch(layer, expert, b)
        if state.prefetch and self.next_router is not None:
            self.look_ahead(hidden_states)
        out = torch.zeros_like(hidden_states)
        admitted = self.admitted(top_k_index)
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < self.num_experts:
                continue  # some families mark dropped slots with an out-of-range id
            token, slot = torch.where(top_k_index == expert)
            widths = bits[token, slot]
            state.skipped_slots += int((widths == 0).sum())
            for width in sorted(set(widths.tolist()), reverse=True):
                if width == 0:
                    continue
                state.last_bits[(self.layer, expert)] = width
                pick = widths == width
                rows, cols = token[pick], slot[pick]
                with self.cache.pinned(self.layer, [expert]):
                    weights = self.cache.get(self.layer, expert, width, fill=expert in admitted)
                    y = self.expert_forward(weights, hidden_states[rows]) * top_k_weights[rows, cols, None]
                out.index_add_(0, rows, y.to(out.dtype))
        return out


# ------------------------------------------------------------------------------------------ the runtime


@dataclass
class RunStats:
    """What `hexq run --stats` reports (tpot_seconds: the median decode step)."""

    budget_bytes: int
    expert_bytes: int
    peak_bytes: int
    cache: CacheStats
    prefetch: PrefetchStats
    skipped_slots: int
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    tokens_per_second: float | None = None
    generated_tokens: int = 0

    def as_dict(self) -> dict:
        cache = asdict(self.cache)
        cache["hit_rate"] = self.cache.hit_rate
        layers = sorted(set(self.cache.layer_hits) | set(self.cache.layer_misses))
        cache["layer_hit_rate"] = {str(layer): self.cache.layer_hits.get(layer, 0)
                                   / max(1, self.cache.layer_hits.get(layer, 0) + self.cache.layer_misses.get(layer, 0))
                                   for layer in layers}
        return {"budget_bytes": self.budget_bytes, "expert_bytes": self.expert_bytes, "peak_bytes": self.peak_bytes,
                "cache": cache, "prefetch": {**asdict(self.prefetch), "precision": self.prefetch.precision,
                                             "recall": self.prefetch.recall},
                "skipped_slots": self.skipped_slots, "ttft_seconds": self.ttft_seconds,
                "tpot_seconds": self.tpot_seconds, "tokens_per_second": self.tokens_per_second,
                "generated_tokens": self.generated_tokens}


def policy_context(artifact: Artifact, hot_fraction: float | None = None) -> PolicyContext:
    """The artifact's facts for the policies; hot_fraction overrides the pack recipe's."""
    stats = {key: artifact.tensor(STATS_SHARD, key) for key in ("loss_table", "loss_table.skip")}
    pack = artifact.manifest["recipe"]["pack"]
    allocation = artifact.allocation
    return PolicyContext(allocation=allocation, loss_table=stats["loss_table"].float(),
                         skip_loss=stats["loss_table.skip"].float(), table_bits=tuple(artifact.replica_bits),
                         avg_bits=artifact.manifest["allocation"]["average_bits"],
                         hot_fraction=hot_fraction or pack["hot_fraction"], top_k=artifact.manifest["model"]["top_k"])


def check_policy_widths(artifact: Artifact, policy) -> None:
    """Every width the policy may ask for is stored for every expert, or a one-line error names the --bank."""
    needed = policy.widths()
    missing = sorted({b for b in needed for row in range(len(artifact.moe_layers))
                      for e in range(artifact.num_experts) if b not in artifact.stored_bits(row, e)})
    if missing:
        raise HexqError(f"policy {policy.name} needs every expert at {sorted(needed)} bits but {artifact.path} "
                        f"stores only the allocation plus {artifact.bank_bits or 'nothing'}; pack with "
                        f"--bank {policy.name} (or --bank {','.join(map(str, missing))})")


class Runtime:
    """An artifact loaded for serving: the model with CachedExperts, its cache, policy and counters."""

    def __init__(self, path: str | Path, budget_bytes: int | None = None, policy: str = "static",
                 prefetch: bool = True, mode: str = "cache", prefetch_top_t: int = 0, device: str | None = None,
                 policy_options: dict | None = None, hot_fraction: float | None = None) -> None:
        if mode not in MODES:
            raise HexqError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.artifact = Artifact(path)
        num_layers, num_experts = len(self.artifact.moe_layers), self.artifact.num_experts
        self.state = RunState(prefetch=prefetch and mode == "cache", prefetch_top_t=prefetch_top_t, mode=mode)
        self.policy = make_policy(policy, policy_context(self.artifact, hot_fraction), **(policy_options or {}))
        check_policy_widths(self.artifact, self.policy)
        source = ArtifactSource(self.artifact)
        self.expert_bytes = source.expert_nbytes * num_layers * num_experts
        budget = self.expert_bytes if budget_bytes is None else budget_bytes
        if budget < source.expert_nbytes:
            raise HexqError(f"budget {budget} bytes cannot hold one expert; the minimum is {source.expert_nbytes} "
                            f"bytes ({source.expert_nbytes / 2**20:.2f} MiB); all experts take {self.expert_bytes}")
        self.cache = ExpertCache(source, budget)
        self.budget_bytes = budget
        self.state.layer_share = max(1, budget // source.expert_nbytes // num_layers)
        adapter = adapter_for(self.artifact.manifest["model"]["model_type"])
        modules: dict[int, CachedExperts] = {}

        def factory(layer: int, old: torch.nn.Module) -> CachedExperts:
            modules[layer] = CachedExperts(layer, num_experts, self.cache, self.policy, self.state, old.act_fn,
                                           expert_quantizers(self.artifact, layer))
            return modules[layer]

        self.model, self.tokenizer = build_model(self.artifact, factory, resolve_device(device), torch.float32)
        layers = [self.model.model.layers[index] for index in self.artifact.moe_layers]
        routers = [getattr(getattr(layer, adapter.moe), adapter.router) for layer in layers]
        norms = [getattr(layer, adapter.post_attention_norm).weight.detach() for layer in layers]
        for layer, module in modules.items():  # look-ahead: layer l holds layer l+1's router
            if layer + 1 < num_layers:
                module.next_router = routers[layer + 1]
                module.norm_ratio = torch.where(norms[layer] != 0, norms[layer + 1] / norms[layer], 0.0)
                module.default_bits_next = self.artifact.allocation[layer + 1]
        self.device = next(self.model.parameters()).device
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm(self) -> None:
        """Load every expert at the artifact's allocation (as far as the budget allows) before timing starts."""
        for layer, row in enumerate(self.artifact.allocation):
            for expert, bits in enumerate(row):
                if bits:
                    self.cache.prefetch(layer, expert, bits)
        self.cache.wait_idle()

    def stats(self, **timing) -> RunStats:
        return RunStats(self.budget_bytes, self.expert_bytes, self.cache.budget.peak, self.cache.stats,
                        self.state.prefetch_stats, self.state.skipped_slots, **timing)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, past=None, prefill: bool = True):
        self.state.prefill = prefill
        return self.model(ids.to(self.device), past_key_values=past, use_cache=past is not None or not prefill)

    @torch.no_grad()
    def window_nll(self, window: torch.Tensor) -> torch.Tensor:
        """Summed next-token NLL of one window scored as a prefill (a new sequence for the policy)."""
        self.policy.begin_sequence()
        self.state.prefill = True
        logits = self.model(window[None].to(self.device)).logits[0, :-1].float()
        self.policy.end_prefill()
        return torch.nn.functional.cross_entropy(logits, window[1:].to(self.device), reduction="sum")

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int, on_text: Callable[[str], None] | None = None,
                 temperature: float = 0.0, seed: int = 0) -> tuple[str, RunStats]:
        """Greedy (temperature 0) or sampled continuation of `prompt`, streamed through on_text."""
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise HexqError("the prompt is empty")
        if self.context and ids.shape[1] + max_new_tokens > self.context:
            raise HexqError(f"prompt ({ids.shape[1]} tokens) + {max_new_tokens} new tokens exceed the model's "
                            f"context of {self.context}")
        generator = torch.Generator().manual_seed(seed)
        self.policy.begin_sequence()
        started = time.perf_counter()
        self.state.prefill = True
        out = self.model(ids.to(self.device), use_cache=True)
        self.policy.end_prefill()
        tokens: list[int] = []
        steps: list[float] = []  # seconds of each decode forward pass
        text = ""
        ttft = None
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].float()
            if temperature > 0:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=generator))
            else:
                token = int(logits.argmax())
            if ttft is None:
                ttft = time.perf_counter() - started
            tokens.append(token)
            new_text = self.tokenizer.decode(tokens)
            if on_text is not None:
                on_text(new_text[len(text):])
            text = new_text
            if token == self.tokenizer.eos_token_id:
                break
            self.state.prefill = False
            step = time.perf_counter()
            out = self.model(torch.tensor([[token]], device=self.device), past_key_values=out.past_key_values,
                             use_cache=True)
            steps.append(time.perf_counter() - step)
        total = time.perf_counter() - started
        # the median decode step: one scheduler hiccup on a shared machine should not move the figure
        tpot = statistics.median(steps) if steps else None
        return text, self.stats(ttft_seconds=ttft, tpot_seconds=tpot,
                                tokens_per_second=len(tokens) / total if total > 0 else None,
                                generated_tokens=len(tokens))
