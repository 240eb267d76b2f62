"""`hexq run`: an artifact served under one memory budget for the whole process.

Memory. `--memory` is one budget for everything hexq allocates: the dense part (attention, norms, routers, shared
experts, embeddings, head) materialized in `--dtype`, the load scratch (per loading thread a pread buffer for one
packed expert, plus one transient expert for bypass loads, plus the torch path's code buffer when the dequantization
kernel is not available), and the fast tier, which gets the rest. `--budget` is the fast tier alone. Nothing of the
artifact is memory-mapped while serving: experts are read with pread into the scratch (Artifact.read_expert), so the
page cache holds the artifact, not the process. The fast tier is a pool of fixed slots, one expert each, allocated
once and reused (no allocator churn, no page faults on a refill), and experts are stored in `--cache-dtype` (bf16 by
default: half of fp32, and faster to compute with on CPUs with bf16 dot products).

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
     it while it computes, highest requested width first so lower-width requests reuse it (004 §4.4.2). A miss
     that would evict is decided by the cost model (hexq.runtime.cost.admit_fill): fill, or compute from a
     transient load, by the expected load time each choice costs over the next tokens, from per-expert usage
     estimates (calibration router counts as the prior, then a moving average of the served traffic).

The cache starts warm (`warm`): the placement `hexq pack` computed (003 Algorithm 2, scheme 3: the manifest's
two-stage placement) or scheme 1 / 2 from the artifact's router traces, with as many experts per layer as the fast
tier holds. A miss reads the packed replica (pread), then unpacks and dequantizes it in one pass straight into its
slot (hexq.packed.kernel; the torch path when the kernel is unavailable). On CUDA the fast tier lives in device
memory: the packed bytes are copied to the device and dequantized there.

Correctness: with the `static` policy the result of every forward pass is bit-identical for every budget (the
experts are visited in the same ascending order, computed by the same function from the same dequantized weights),
and in the fp32 mode (--dtype fp32 --cache-dtype fp32) it equals the streamed `hexq eval` of the artifact
(hexq.runtime.model.artifact_model).
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hexq.adapters import adapter_for
from hexq.algos.placement import place, ranked
from hexq.artifact.format import STATS_SHARD
from hexq.artifact.reader import Artifact
from hexq.devices import resolve_device
from hexq.errors import HexqError
from hexq.packed.bitpack import DequantScratch
from hexq.packed.kernel import DequantKernel, dequantize_packed_fast, load_kernel
from hexq.packed.weight import PackedWeight, packed_weight_nbytes
from hexq.runtime.cache import CacheStats, ExpertCache, ExpertWeights
from hexq.runtime.cost import admit_fill, calibration_usage, usage_update
from hexq.runtime.model import build_model, dense_plan_bytes, expert_quantizers, skeleton
from hexq.runtime.policy import PolicyContext, make_policy
from hexq.simulate import quantized_expert_output
from hexq.streaming import blocked_nll

MODES = ("cache", "ondemand")  # ondemand: no fast tier, every expert loaded from the slow tier at each use
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARM = ("none", "1", "2", "3")  # placement schemes of 003 Algorithm 2 (hexq.algos.placement)
LOADERS = 2  # threads that load experts: the forward pass and the prefetch worker
# Tokens over which the per-expert usage estimates average (hexq.runtime.cost.usage_update). Short, so that the
# estimate follows the traffic's locality: decoding 3 x 64 tokens after 128-token prompts on the reference models at
# 25% and 50% of the experts' bytes, 16 gave the highest hit rates of 4, 16, 64 and 256 in 9 of 12 sequences, and
# beat plain LRU in 11 of 12 (mixtral 50%: 0.79 / 0.86 / 0.87 against LRU's 0.79 / 0.77 / 0.72).
USAGE_HORIZON = 16.0


def parse_dtype(value: str | torch.dtype, option: str) -> torch.dtype:
    """bf16 / fp32 (or the torch dtype) for --dtype and --cache-dtype."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if value not in DTYPES:
        raise HexqError(f"{option} {value}: choose one of {', '.join(DTYPES)}")
    return DTYPES[value]


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------ the slow tier


class _LoaderScratch:
    """One loading thread's buffers: the pread buffer for one packed expert (pinned host memory on CUDA), its copy
    on the device (CUDA), the torch path's code buffer (without the kernel) and the transient expert of bypass
    loads (allocated on the thread's first bypass)."""

    def __init__(self, source: ArtifactSource) -> None:
        cuda = source.device.type == "cuda"
        self.read = torch.empty(source.read_nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
        self.staging = torch.empty(source.read_nbytes, dtype=torch.uint8, device=source.device) if cuda else None
        self.codes = None if source.kernel is not None else DequantScratch(source.max_numel, source.device)
        self.transient: torch.Tensor | None = None


class ArtifactSource:
    """The slow tier (the artifact) and the memory of the fast tier (a pool of `slots` expert slots in `dtype` on
    `device`, each allocated on first use and reused). `load` fills a slot, `recycle` gives it back (the cache calls it
    for every version it stops counting), `load_transient` writes the calling thread's bypass buffer. Layers are MoE
    rows (the artifact's allocation rows), as everywhere in the runtime."""

    def __init__(self, artifact: Artifact, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
                 slots: int = 0, kernel: DequantKernel | None = None) -> None:
        self.artifact, self.dtype, self.device = artifact, dtype, device or torch.device("cpu")
        self.kernel = kernel if self.device.type == "cpu" else None
        self.shapes = [artifact.expert_shape(p) for p in ("gate_up", "down")]
        self.numels = [rows * cols for rows, cols in self.shapes]
        self.max_numel = max(self.numels)
        self.expert_nbytes = sum(self.numels) * dtype.itemsize
        self.read_nbytes = self.packed_nbytes_max(artifact)
        self.slots = slots
        self._pool: list[torch.Tensor] = []  # slot memory, created on first use, never freed while serving
        self._free: list[int] = []
        self._slot_of: dict[int, int] = {}  # data_ptr of a slot's gate_up -> slot
        self._lock = threading.Lock()
        self._local = threading.local()
        self.load_seconds: dict[int, list[float]] = {}  # width -> [total seconds, loads]

    @staticmethod
    def packed_nbytes_max(artifact: Artifact) -> int:
        """Bytes of the pread buffer: the largest stored replica (both matrices, codes + scale + zero) plus the
        alignment read_spans_into may add (8 bytes per tensor)."""
        group = artifact.manifest["experts"].get("group_size")
        widths = {b for row in artifact.allocation for b in row if b} | set(artifact.bank_bits)
        shapes = [artifact.expert_shape(p) for p in ("gate_up", "down")]
        return max((sum(packed_weight_nbytes(s, b, group or s[1]) for s in shapes) for b in widths), default=0) + 48

    def scratch_nbytes(self) -> int:
        """Bytes of load scratch the runtime reserves: per loading thread a pread buffer (and its device copy, and
        the torch path's code buffer without the kernel), plus the forward pass's transient expert."""
        per_thread = self.read_nbytes * (2 if self.device.type == "cuda" else 1)
        if self.kernel is None:
            per_thread += DequantScratch.nbytes_for(self.max_numel)
        return LOADERS * per_thread + self.expert_nbytes

    def nbytes(self, layer: int, expert: int, bits: int) -> int:
        return self.expert_nbytes

    # --- memory

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = flat.split(self.numels)
        return gate_up.view(self.shapes[0]), down.view(self.shapes[1])

    def _take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._pool[self._free.pop()]
            if len(self._pool) >= self.slots:
                raise RuntimeError(f"all {self.slots} expert slots are in use: the cache's byte accounting and the "
                                   "slot pool disagree")
            flat = torch.empty(sum(self.numels), dtype=self.dtype, device=self.device)
            self._slot_of[flat.data_ptr()] = len(self._pool)
            self._pool.append(flat)
            return flat

    def recycle(self, weights: ExpertWeights) -> None:
        """Give a slot back (the cache calls this once the version in it is unpublished and unpinned)."""
        slot = self._slot_of.get(weights.gate_up.data_ptr())
        if slot is not None:
            with self._lock:
                self._free.append(slot)

    def _scratch(self) -> _LoaderScratch:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = _LoaderScratch(self)
        return scratch

    # --- loads

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        flat = self._take()
        try:
            return self._load_into(flat, layer, expert, bits)
        except BaseException:
            with self._lock:
                self._free.append(self._slot_of[flat.data_ptr()])
            raise

    def load_transient(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        """Load into the calling thread's bypass buffer (valid until this thread's next transient load)."""
        scratch = self._scratch()
        if scratch.transient is None:
            scratch.transient = torch.empty(sum(self.numels), dtype=self.dtype, device=self.device)
        return self._load_into(scratch.transient, layer, expert, bits)

    def _load_into(self, flat: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
        started = time.perf_counter()
        scratch = self._scratch()
        packed = self.artifact.read_expert(layer, expert, bits, scratch.read)
        if scratch.staging is not None:
            packed = tuple(_to_device(weight, scratch.staging) for weight in packed)
        gate_up, down = self._views(flat)
        for out, weight in zip((gate_up, down), packed, strict=True):
            dequantize_packed_fast(out, weight, self.kernel, scratch.codes)
        if scratch.staging is not None:  # the staging buffer is reused by this thread's next load
            torch.cuda.current_stream(self.device).synchronize()
        elapsed = time.perf_counter() - started
        with self._lock:
            total = self.load_seconds.setdefault(bits, [0.0, 0])
            total[0] += elapsed
            total[1] += 1
        return ExpertWeights(bits, gate_up, down)

    def mean_load_seconds(self, bits: int) -> float:
        """Measured mean seconds of one load at `bits` (the mean over all widths before the first at `bits`; 1.0
        before any load): T_e of the cost model."""
        total = self.load_seconds.get(bits)
        if total and total[1]:
            return total[0] / total[1]
        done = [t for t in self.load_seconds.values() if t[1]]
        return sum(t[0] for t in done) / sum(t[1] for t in done) if done else 1.0


def _to_device(weight: PackedWeight, staging: torch.Tensor) -> PackedWeight:
    """The packed weight's tensors copied (as packed bytes) into the device staging buffer, at the byte offsets they
    have in the host read buffer."""
    moved = []
    for tensor in (weight.codes, weight.scale, weight.zero):
        start = tensor.storage_offset() * tensor.element_size()
        target = staging[start:start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        target.copy_(tensor, non_blocking=True)
        moved.append(target)
    return PackedWeight(*moved, weight.bits, weight.shape)


# ------------------------------------------------------------------------------------------ one layer's experts


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
                 quantizers, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.layer, self.num_experts = layer, num_experts
        self.cache, self.policy, self.state = cache, policy, state
        self.act_fn = act_fn
        self.input_quant, self.mid_quant = quantizers
        self.compute_dtype = compute_dtype  # the fast tier's dtype: inputs are cast to it, never the weights
        # look-ahead, set by Runtime once every layer exists (None in the last layer)
        self.next_router: torch.nn.Module | None = None  # layer l+1's router
        self.norm_ratio: torch.Tensor | None = None  # w_{l+1} / w_l of the post-attention norms
        self.default_bits_next: list[int] = []  # layer l+1's allocation

    def expert_forward(self, weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
        return quantized_expert_output(x.to(self.compute_dtype), weights.gate_up, weights.down, self.act_fn,
                                       self.input_quant, self.mid_quant)

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
    """What `hexq run --stats` reports (tpot_seconds: the median decode step). Bytes: memory_bytes the whole budget
    (None without --memory), dense_bytes the materialized dense part, scratch_bytes the load scratch, budget_bytes
    the fast tier, peak_bytes its high-water mark; bytes_read what was read from the artifact's expert shards;
    peak_rss_bytes the process's VmHWM (None where /proc is missing)."""

    budget_bytes: int
    expert_bytes: int
    peak_bytes: int
    cache: CacheStats
    prefetch: PrefetchStats
    skipped_slots: int
    dense_bytes: int = 0
    scratch_bytes: int = 0
    memory_bytes: int | None = None
    bytes_read: int = 0
    warm_experts: int = 0
    dtype: str = "bf16"
    cache_dtype: str = "bf16"
    kernel: bool = False
    peak_rss_bytes: int | None = None
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
        out = {key: value for key, value in asdict(self).items() if key not in ("cache", "prefetch")}
        return out | {"cache": cache, "prefetch": {**asdict(self.prefetch), "precision": self.prefetch.precision,
                                                   "recall": self.prefetch.recall}}


def peak_rss_bytes() -> int | None:
    """The process's peak resident set (VmHWM of /proc/self/status), or None where there is no /proc."""
    try:
        with open("/proc/self/status") as handle:
            match = re.search(r"VmHWM:\s+(\d+) kB", handle.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


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


def warm_order(artifact: Artifact, scheme: str, slots: int) -> list[tuple[int, int]]:
    """The experts a warm start loads, at most `slots`, least valuable first (so LRU evicts them first): K = slots //
    layers per layer by 003 Algorithm 2 scheme `scheme` (3: the manifest's two-stage placement when pack computed it
    for the same K, else recomputed from the router traces; 1: paths; 2: frequency), then the remaining slots to the
    most frequently routed experts left (calibration counts). Skipped experts (allocation 0) are never loaded."""
    if scheme == "none" or slots <= 0:
        return []
    L, E = len(artifact.moe_layers), artifact.num_experts
    counts = artifact.tensor(STATS_SHARD, "router.counts").long()
    K = min(E, slots // L)
    placement = artifact.manifest["placement"]
    if scheme == "3" and placement.get("scheme") == "two_stage" and placement.get("hot_per_layer") == K:
        mask = torch.zeros(L, E, dtype=torch.bool, device=counts.device)
        for row, hot in enumerate(placement["hot"]):
            mask[row, hot] = True
    else:
        topk = artifact.tensor(STATS_SHARD, "router.topk").long()
        mask = place(scheme, topk, counts, K)
    artifact.release()
    allowed = torch.tensor(artifact.allocation, dtype=torch.long, device=counts.device) > 0
    chosen = mask & allowed
    order = ranked(counts)  # [L, E] by frequency, best first
    picks = [(int(counts[row, e]), row, e) for row in range(L) for e in order[row].tolist() if chosen[row, e]]
    rest = sorted(((int(counts[row, e]), row, e) for row in range(L) for e in range(E)
                   if allowed[row, e] and not chosen[row, e]), key=lambda t: (-t[0], t[1], t[2]))
    picks += rest[:max(0, slots - len(picks))]
    picks.sort(key=lambda t: (t[0], t[1], t[2]))  # least frequent first
    return [(row, e) for _, row, e in picks[-slots:]]


class Runtime:
    """An artifact loaded for serving: the model with CachedExperts, its cache, policy and counters.

    memory_bytes: the whole budget (dense part + load scratch + fast tier); budget_bytes: the fast tier alone (give
    at most one; neither: room for every expert). dtype / cache_dtype: "bf16" or "fp32" for the dense part and the
    fast tier. warm: "none" or a placement scheme "1", "2", "3" for the warm start. admission: the per-miss cost
    model (False: every miss fills, plain LRU). kernel: use the compiled dequantization kernel when available.
    """

    def __init__(self, path: str | Path, budget_bytes: int | None = None, policy: str = "static",
                 prefetch: bool = True, mode: str = "cache", prefetch_top_t: int = 0, device: str | None = None,
                 policy_options: dict | None = None, hot_fraction: float | None = None, *,
                 memory_bytes: int | None = None, dtype: str | torch.dtype = "bf16",
                 cache_dtype: str | torch.dtype = "bf16", warm: str = "3", admission: bool = True,
                 kernel: bool = True) -> None:
        if mode not in MODES:
            raise HexqError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if warm not in WARM:
            raise HexqError(f"--warm {warm}: choose one of {', '.join(WARM)}")
        if memory_bytes is not None and budget_bytes is not None:
            raise HexqError("give --memory (the whole process) or --budget (the experts alone), not both")
        self.dtype, self.cache_dtype = parse_dtype(dtype, "--dtype"), parse_dtype(cache_dtype, "--cache-dtype")
        self.artifact = Artifact(path)
        try:
            self._build(budget_bytes, memory_bytes, policy, prefetch, mode, prefetch_top_t, resolve_device(device),
                        policy_options, hot_fraction, warm, admission, kernel)
        except BaseException:
            cache = getattr(self, "cache", None)
            if cache is not None:
                cache.close()
            self.artifact.close()
            raise

    def _build(self, budget_bytes, memory_bytes, policy, prefetch, mode, prefetch_top_t, device, policy_options,
               hot_fraction, warm, admission, kernel) -> None:
        artifact = self.artifact
        num_layers, num_experts = len(artifact.moe_layers), artifact.num_experts
        self.state = RunState(prefetch=prefetch and mode == "cache", prefetch_top_t=prefetch_top_t, mode=mode)
        self.policy = make_policy(policy, policy_context(artifact, hot_fraction), **(policy_options or {}))
        check_policy_widths(artifact, self.policy)
        streamed = skeleton(artifact, device, self.dtype)
        self.dense_bytes = dense_plan_bytes(streamed)
        source = ArtifactSource(artifact, self.cache_dtype, device, kernel=load_kernel() if kernel else None)
        self.scratch_bytes = source.scratch_nbytes()
        self.expert_bytes = source.expert_nbytes * num_layers * num_experts
        self.memory_bytes = memory_bytes
        one = source.expert_nbytes
        if memory_bytes is not None:
            budget = memory_bytes - self.dense_bytes - self.scratch_bytes
            minimum = self.dense_bytes + self.scratch_bytes + one
            if budget < one:
                raise HexqError(f"--memory {mib(memory_bytes)} is below the minimum of {mib(minimum)} ({minimum} "
                                f"bytes): the dense part takes {mib(self.dense_bytes)} in {streamed.dtype}, one "
                                f"expert {mib(one)} and the load scratch {mib(self.scratch_bytes)}")
        else:
            budget = self.expert_bytes if budget_bytes is None else budget_bytes
            if budget < one:
                raise HexqError(f"budget {budget} bytes cannot hold one expert; the minimum is {one} bytes "
                                f"({one / 2**20:.2f} MiB); all experts take {self.expert_bytes}")
        budget = min(budget, self.expert_bytes)  # room beyond every expert would stay unused
        source.slots = budget // one if mode == "cache" else 0
        self.source = source
        counts = artifact.tensor(STATS_SHARD, "router.counts")
        self.state.usage = calibration_usage(counts.to("cpu"), artifact.manifest["model"]["top_k"])
        artifact.release()
        self.cache = ExpertCache(source, budget, self._admit if admission else None)
        self.budget_bytes = budget
        self.state.layer_share = max(1, budget // one // num_layers)
        adapter = adapter_for(artifact.manifest["model"]["model_type"])
        modules: dict[int, CachedExperts] = {}

        def factory(layer: int, old: torch.nn.Module) -> CachedExperts:
            modules[layer] = CachedExperts(layer, num_experts, self.cache, self.policy, self.state, old.act_fn,
                                           expert_quantizers(artifact, layer), self.cache_dtype)
            return modules[layer]

        self.model, self.tokenizer = build_model(artifact, factory, device, self.dtype, streamed)
        artifact.release()  # the dense shards' maps: only tensors the model holds stay
        layers = [self.model.model.layers[index] for index in artifact.moe_layers]
        routers = [getattr(getattr(layer, adapter.moe), adapter.router) for layer in layers]
        norms = [getattr(layer, adapter.post_attention_norm).weight.detach() for layer in layers]
        for layer, module in modules.items():  # look-ahead: layer l holds layer l+1's router
            if layer + 1 < num_layers:
                module.next_router = routers[layer + 1]
                module.norm_ratio = torch.where(norms[layer] != 0, norms[layer + 1] / norms[layer], 0.0)
                module.default_bits_next = artifact.allocation[layer + 1]
        self.device = next(self.model.parameters()).device
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.warm_experts = self.warm(warm) if mode == "cache" else 0

    def _admit(self, key: tuple[int, int], bits: int, victims: list[tuple[tuple[int, int], int]],
               prefetch: bool) -> bool:
        """The per-miss cost model (hexq.runtime.cost.admit_fill) on the current usage estimates."""
        usage = self.state.usage
        new = usage[key]
        if prefetch:  # predicted for the next token: valued as it will be once that use is counted
            new = usage_update(new, torch.ones((), dtype=new.dtype, device=new.device), 1, USAGE_HORIZON)
        return admit_fill(float(new), self.source.mean_load_seconds(bits),
                          [(float(usage[k]), self.source.mean_load_seconds(b)) for k, b in victims])

    def close(self) -> None:
        self.cache.close()
        self.artifact.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm(self, scheme: str = "3") -> int:
        """Load the warm start's experts (warm_order) at the artifact's allocation before serving; the cache's
        counters start after it. Returns how many experts were loaded."""
        order = warm_order(self.artifact, scheme, self.source.slots)
        for layer, expert in order:
            self.cache.prefetch(layer, expert, self.artifact.allocation[layer][expert])
        self.cache.wait_idle()
        self.cache.reset_stats()
        self.source.load_seconds.clear()  # the first loads of a shard include its one-time hash check
        return len(self.cache.resident())

    def fill_all(self) -> None:
        """Load every expert at the artifact's allocation (as far as the budget allows): the all-resident setup."""
        for layer, row in enumerate(self.artifact.allocation):
            for expert, bits in enumerate(row):
                if bits:
                    self.cache.prefetch(layer, expert, bits)
        self.cache.wait_idle()
        self.cache.reset_stats()

    def stats(self, **timing) -> RunStats:
        names = {v: k for k, v in DTYPES.items()}
        return RunStats(self.budget_bytes, self.expert_bytes, self.cache.budget.peak, self.cache.stats,
                        self.state.prefetch_stats, self.state.skipped_slots, dense_bytes=self.dense_bytes,
                        scratch_bytes=self.scratch_bytes, memory_bytes=self.memory_bytes,
                        bytes_read=self.artifact.bytes_read, warm_experts=self.warm_experts,
                        dtype=names[self.dtype], cache_dtype=names[self.cache_dtype],
                        kernel=self.source.kernel is not None, peak_rss_bytes=peak_rss_bytes(), **timing)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, past=None, prefill: bool = True):
        self.state.prefill = prefill
        return self.model(ids.to(self.device), past_key_values=past, use_cache=past is not None or not prefill)

    @torch.no_grad()
    def window_nll(self, window: torch.Tensor) -> torch.Tensor:
        """Summed next-token NLL of one window scored as a prefill (a new sequence for the policy). The head is
        applied in vocabulary blocks (hexq.streaming.blocked_nll): no [positions, vocab] logits exist at once."""
        self.policy.begin_sequence()
        self.state.prefill = True
        hidden = self.model.model(window[None].to(self.device)).last_hidden_state[0, :-1]
        self.policy.end_prefill()
        head = self.model.lm_head
        nll = blocked_nll(hidden, head.weight, getattr(head, "bias", None), window[1:].to(self.device), 16384,
                          self.dtype)
        return nll.double().sum()

    def _next_logits(self, ids: torch.Tensor, past) -> tuple[torch.Tensor, object]:
        """(float32 logits [vocab] at the last position, KV cache) of one forward pass. The head is applied to a copy
        of the last position's hidden state: on CPU, torch's linear takes a path ~100x slower for a [1, 1, H] view
        of a longer sequence (what logits_to_keep=1 gives after a prompt: 6 s instead of 0.06 s for Qwen3-30B-A3B's
        151936 x 2048 head), and every family's causal-LM head is this one linear."""
        out = self.model.model(ids.to(self.device), past_key_values=past, use_cache=True)
        last = out.last_hidden_state[0, -1:].clone()
        return self.model.lm_head(last)[0].float(), out.past_key_values

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
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.policy.begin_sequence()
        started = time.perf_counter()
        self.state.prefill = True
        logits, past = self._next_logits(ids, None)
        self.policy.end_prefill()
        tokens: list[int] = []
        steps: list[float] = []  # seconds of each decode forward pass
        text = ""
        ttft = None
        for _ in range(max_new_tokens):
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
            logits, past = self._next_logits(torch.tensor([[token]], device=self.device), past)
            steps.append(time.perf_counter() - step)
        total = time.perf_counter() - started
        # the median decode step: one scheduler hiccup on a shared machine should not move the figure
        tpot = statistics.median(steps) if steps else None
        return text, self.stats(ttft_seconds=ttft, tpot_seconds=tpot,
                                tokens_per_second=len(tokens) / total if total > 0 else None,
                                generated_tokens=len(tokens))
