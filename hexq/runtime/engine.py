"""`hexq run`: an artifact served under one memory budget for the whole process, computed from its packed codes.

Memory. `--memory` is one budget for everything hexq allocates: the dense part (attention, norms, routers, shared
experts, embeddings, head; quantized linears kept as their packed codes, the rest in `--dtype`), the scratch (the
load buffers of hexq.runtime.source and the compute's expansion matrices of hexq.runtime.compute), the KV cache of
one sequence of `--context` positions (kv_position_bytes), and the fast tier, which gets the rest. `--fast-tier` is
the fast tier alone. The plan is made once (hexq.runtime.memory.MemoryPlan, `Runtime.plan`). Nothing of the
artifact is memory-mapped while serving: experts are read with pread, so the page cache holds the artifact, not the
process. The fast tier holds experts as their stored packed bytes by default
(`--cache packed`: a 3-bit expert takes ~0.25x its bf16 bytes), or expanded into bf16 / fp32 matrices
(`--cache bf16|fp32`).

Compute. Experts and quantized dense linears are computed from their codes by the CPU kernels (hexq.packed.cpu:
AVX-512 VNNI, AVX2 or portable C, picked for this CPU; `--stats` names the path) or expanded into a scratch matrix
for a BLAS product where the measured cost model says that pays (a prefill expert with many tokens);
hexq.runtime.compute has the rule. Without the kernels, or with `--kernels torch`, every matrix is expanded by the
torch path: the same numbers as `hexq eval` in the fp32 mode, far slower.

The model is built from the artifact (hexq.runtime.model) with one replacement for every layer's routed-experts
module, `CachedExperts` (hexq.runtime.experts: routing by width, look-ahead prefetch, the cache, the compute), and
one for every quantized dense linear, `PackedLinear` (hexq.runtime.compute). The family's own code runs everything
else, so routing is exactly the model's.

The cache (hexq.runtime.cache: budgeted mixed-precision LRU, versioned handles, a prefetch worker) starts warm
(`warm`): the placement `hexq pack` computed (003 Algorithm 2, scheme 3) or scheme 1 / 2 from the artifact's router
traces, with as many experts per layer as the fast tier holds. A miss that would evict is decided by the per-miss
cost model (hexq.runtime.cost.admit_fill).

Correctness. Start-up checks the compute against a float64 reference on a few tokens for one expert at every stored
width and one dense linear (hexq.runtime.self_check): a device or kernel that computes wrong numbers stops `hexq run`
with a one-line error instead of serving them. With the `static` policy the result of every forward pass is the same for
every budget (experts are grouped in the same order and computed by the same function whatever is resident, and the
cost model's choices come from latencies measured once per machine and kept: hexq.runtime.compute.cached_profile).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hexq.artifact.format import STATS_SHARD
from hexq.artifact.reader import Artifact
from hexq.base.devices import peak_rss_bytes, resolve_device, return_freed_memory
from hexq.base.errors import HexqError
from hexq.model.adapters import adapter_for
from hexq.model.attention import fused_on
from hexq.model.folder import context_length
from hexq.model.streaming import blocked_nll
from hexq.runtime.cache import ExpertCache
from hexq.runtime.compute import EXPAND_ROWS, SCORING_DTYPE, Compute, compute_backend, weight_rows
from hexq.runtime.cost import admit_fill, calibration_usage, usage_update
from hexq.runtime.coverage import NotNative
from hexq.runtime.experts import USAGE_HORIZON, CachedExperts, RunState
from hexq.runtime.graph import GraphDecoder
from hexq.runtime.memory import check_memory_flags, head_dims, kv_position_bytes, plan_memory, prefill_scratch_nbytes
from hexq.runtime.model import build_model, dense_plan_bytes, expert_quantizers, skeleton
from hexq.runtime.native import KV_CACHES, NativeDecoder
from hexq.runtime.policy import check_policy_widths, make_policy, policy_context
from hexq.runtime.prefix import exact_copy, prefix_cache, reusable_positions
from hexq.runtime.residency import FastTier
from hexq.runtime.sampling import Sampling, TextStream, next_token
from hexq.runtime.self_check import self_check
from hexq.runtime.source import CACHE_FORMATS, ArtifactSource, SlotSizes
from hexq.runtime.stats import RunStats
from hexq.runtime.warm import warm_order

MODES = ("cache", "ondemand")  # ondemand: no fast tier, every expert loaded from the slow tier at each use
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARM = ("none", "1", "2", "3")  # placement schemes of 003 Algorithm 2 (hexq.algos.placement)
KERNELS = ("auto", "cpu", "triton", "torch")
# How a generated token is computed: the native step where it covers the runtime (hexq.runtime.native), else the
# transformers model; "native" insists (an error naming why not), "transformers" is the reference path.
DECODE = ("auto", "native", "transformers")
GREEDY = Sampling()
# Positions of one sequence the KV cache is planned for when --context is not given (llama.cpp's default context):
# the model's own maximum can be 40960 or more, whose KV cache alone would take gigabytes.
DEFAULT_CONTEXT = 4096
# Prompt tokens per forward pass of a prefill (llama.cpp's batch is 512). A pass's activations grow with its tokens
# (the routed experts' rows of every token most of all): a 2,367-token prompt on a 6-layer Qwen3-30B-A3B shape took
# 945 MiB over the loaded runtime in one pass, 187 MiB in passes of 256, which were also the fastest (10.3-10.6 s
# against 11.7 in one pass, 11.5 in passes of 512, 11.8 of 128; AMD EPYC, 2 threads). The plan holds one pass
# (hexq.runtime.memory.prefill_scratch_nbytes).
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class RuntimeConfig:
    """How an artifact is served (every `hexq run` option that shapes the runtime).

    memory_bytes: the whole budget (dense part + scratch + KV cache + fast tier); fast_tier_bytes: the fast tier
    alone (give at most one; neither: room for every expert; hexq.runtime.memory). dtype: "bf16" or "fp32" for the
    dense part and expanded matrices.
    cache: what the fast tier holds, "packed", "bf16" or "fp32". warm: "none" or a placement scheme "1", "2", "3".
    admission: the per-miss cost model (False: every miss fills, plain LRU). decode: how a generated token is
    computed (DECODE). context: the positions one sequence may take, prompt and generated tokens together, which
    the memory plan holds a KV cache for (None: the model's maximum, at most DEFAULT_CONTEXT). kernels: how packed
    matrices are computed - "auto" (the CPU kernels on the CPU, Triton on CUDA, where they can be had), "cpu",
    "triton" (on the CPU only under TRITON_INTERPRET=1: tests), or "torch" (expand every matrix with torch ops);
    threads: the CPU kernels' threads (None: every core). kv_cache: the native step's KV cache, "f16" or "f32"
    (KV_CACHES).
    """

    memory_bytes: int | None = None
    fast_tier_bytes: int | None = None
    policy: str = "static"
    policy_options: dict = field(default_factory=dict)
    hot_fraction: float | None = None
    prefetch: bool = True
    prefetch_top_t: int = 0
    mode: str = "cache"
    device: str | None = None
    dtype: str = "bf16"
    cache: str = "packed"
    warm: str = "3"
    admission: bool = True
    kernels: str = "auto"
    threads: int | None = None
    decode: str = "auto"
    context: int | None = None
    kv_cache: str = "f16"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise HexqError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.warm not in WARM:
            raise HexqError(f"--warm {self.warm}: choose one of {', '.join(WARM)}")
        if self.dtype not in DTYPES:
            raise HexqError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        if self.kv_cache not in KV_CACHES:
            raise HexqError(f"--kv-cache {self.kv_cache}: choose one of {', '.join(KV_CACHES)}")
        if self.cache not in CACHE_FORMATS:
            raise HexqError(f"--cache {self.cache}: choose one of {', '.join(CACHE_FORMATS)}")
        check_memory_flags(self.memory_bytes, self.fast_tier_bytes)  # before anything is loaded or compiled
        if self.kernels not in KERNELS:
            raise HexqError(f"--kernels {self.kernels}: choose one of {', '.join(KERNELS)}")
        if self.decode not in DECODE:
            raise HexqError(f"--decode {self.decode}: choose one of {', '.join(DECODE)}")
        if self.threads is not None and self.threads < 1:
            raise HexqError(f"--threads {self.threads}: give at least 1")
        if self.context is not None and self.context < 2:
            raise HexqError(f"--context {self.context}: give at least 2 positions")


class Runtime:
    """An artifact loaded for serving: the model with CachedExperts and PackedLinears, its cache, policy, compute
    and counters. `Runtime(path, config)` or `Runtime(path, **fields of RuntimeConfig)`."""

    def __init__(self, path: str | Path, config: RuntimeConfig | None = None, **options) -> None:
        self.config = config if config is not None else RuntimeConfig(**options)
        if config is not None and options:
            raise TypeError("give a RuntimeConfig or its fields, not both")
        self.dtype = DTYPES[self.config.dtype]
        self.artifact = Artifact(path)
        try:
            self._build(self.config, resolve_device(self.config.device))
        except BaseException:
            cache = getattr(self, "cache", None)
            if cache is not None:
                cache.close()
            self.artifact.close()
            raise

    def _build(self, config: RuntimeConfig, device: torch.device) -> None:
        artifact = self.artifact
        num_layers, num_experts = len(artifact.moe_layers), artifact.num_experts
        self.state = RunState(prefetch=config.prefetch and config.mode == "cache",
                              prefetch_top_t=config.prefetch_top_t, mode=config.mode)
        self.policy = make_policy(config.policy, policy_context(artifact, config.hot_fraction),
                                  **config.policy_options)
        check_policy_widths(artifact, self.policy)
        kernels, triton = compute_backend(config.kernels, device, config.threads)
        self.compute = Compute(device, self.dtype, kernels, triton)
        streamed = skeleton(artifact, device, self.dtype)
        maximum = context_length(streamed.config)
        if config.context is not None and maximum and config.context > maximum:
            raise HexqError(f"--context {config.context} is past the model's maximum of {maximum} positions")
        context = config.context or min(maximum or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        sizes = SlotSizes.of(artifact, config.cache, device, kernels is not None)
        allocated = [sizes.slot_bytes[b] for row in artifact.allocation for b in row if b]
        self.plan = plan_memory(
            memory_bytes=config.memory_bytes, fast_tier_bytes=config.fast_tier_bytes,
            dense_bytes=dense_plan_bytes(streamed, artifact),
            scratch_bytes=sizes.scratch_nbytes + compute_scratch_nbytes(artifact, streamed, self.dtype,
                                                                         kernels is None)
            + prefill_scratch_nbytes(streamed.config, artifact, PREFILL_CHUNK, context, self.dtype,
                                     fused_on(device, *head_dims(streamed.config)), torch.get_num_threads()),
            kv_bytes=context * kv_position_bytes(streamed.config, self.dtype, KV_CACHES[config.kv_cache]),
            context=context,
            expert_bytes=sum(allocated), largest_slot=sizes.largest_slot, cache_format=config.cache,
            cached=config.mode == "cache",
            # every expert on the device in one arena per layer, computed without the cache (hexq.runtime.arena)
            arena_possible=triton and config.policy == "static")
        fast_tier = FastTier(self.plan.cache_bytes)
        self.source = source = ArtifactSource(artifact, sizes, fast_tier, kernels)
        counts = artifact.tensor(STATS_SHARD, "router.counts")
        self.state.usage = calibration_usage(counts.to("cpu"), artifact.top_k)
        artifact.release()
        self.cache = ExpertCache(source, fast_tier, self._admit if config.admission else None)
        mean_slot = sum(allocated) / max(1, len(allocated))
        self.slots = int(self.plan.cache_bytes // mean_slot) if mean_slot else 0  # experts the fast tier holds
        self.state.layer_share = max(1, self.slots // num_layers)
        adapter = adapter_for(artifact.model_type)
        modules: dict[int, CachedExperts] = {}

        def factory(layer: int, old: torch.nn.Module) -> CachedExperts:
            modules[layer] = CachedExperts(layer, num_experts, self.cache, self.policy, self.state, old.act_fn,
                                           expert_quantizers(artifact, layer), self.compute)
            return modules[layer]

        self.model, self.tokenizer = build_model(artifact, factory, device, self.dtype, streamed, self.compute)
        artifact.release()  # the dense shards' maps: only tensors the model holds stay
        layers = [self.model.model.layers[index] for index in artifact.moe_layers]
        routers = [getattr(getattr(layer, adapter.moe), adapter.router) for layer in layers]
        norms = [getattr(layer, adapter.post_attention_norm).weight.detach() for layer in layers]
        if self.plan.arena:
            from hexq.runtime.arena import ExpertArena  # it imports triton (~1 s), used on CUDA only

            buffer = torch.empty(sizes.read_nbytes, dtype=torch.uint8, device="cpu")
            for layer, module in modules.items():
                module.arena = ExpertArena(artifact, layer, device, buffer)
            self.state.prefetch = False
        self.arenas = [module.arena for module in modules.values() if module.arena is not None]
        for layer, module in modules.items():  # look-ahead: layer l holds layer l+1's router
            if layer + 1 < num_layers:
                module.next_router = routers[layer + 1]
                module.norm_ratio = torch.where(norms[layer] != 0, norms[layer + 1] / norms[layer], 0.0)
                module.default_bits_next = artifact.allocation[layer + 1]
        self.device = device
        self_check(self, modules[0])
        self.warm_experts = self.warm(config.warm) if config.mode == "cache" and not self.plan.arena else 0
        self.native, self.decode_path = self._decoder(config.decode)
        self.reused = 0  # positions the last sequence took from the one before it (hexq.runtime.prefix)

    def _decoder(self, decode: str) -> tuple[NativeDecoder | GraphDecoder | None, str]:
        """(the native step or None, the decode path as --stats names it) for --decode (see DECODE)."""
        if decode == "transformers":
            return None, "transformers (--decode transformers)"
        try:  # every expert in the device arena: the CUDA graph step, else the native CPU step
            native = GraphDecoder.of(self) if self.plan.arena else NativeDecoder.of(self)
        except NotNative as reason:
            if decode == "native":
                raise HexqError(f"--decode native: {reason}; use --decode auto") from None
            return None, f"transformers ({reason})"
        self.cache.reset_stats()  # the native step took every expert from the cache once
        return native, native.path

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
        order = warm_order(self.artifact, scheme, self.slots)
        for layer, expert in order:
            self.cache.prefetch(layer, expert, self.artifact.allocation[layer][expert])
        self.cache.wait_idle()
        self.cache.reset_stats()
        self.source.load_seconds.clear()  # the first loads of a shard include its one-time hash check
        self.compute.counters = type(self.compute.counters)()
        return len(self.cache.resident())

    def fill_all(self) -> None:
        """Load every expert at the artifact's allocation (as far as the budget allows): the all-resident setup."""
        for layer, row in enumerate(self.artifact.allocation):
            for expert, bits in enumerate(row):
                if bits:
                    self.cache.prefetch(layer, expert, bits)
        self.cache.wait_idle()
        self.cache.reset_stats()

    def skipped_slots(self) -> int:
        """(token, slot) pairs served without their skipped expert: the host's count, or the resident layers' device
        counters (one read here, none in a forward pass)."""
        return self.state.skipped_slots + sum(int(layer.skipped) for layer in self.arenas)

    def stats(self, **timing) -> RunStats:
        counters = self.compute.counters
        kernels = self.compute.kernels
        return RunStats(self.plan, self.cache.fast_tier.peak, self.cache.stats,
                        self.state.prefetch_stats, self.skipped_slots(),
                        bytes_read=self.artifact.bytes_read, warm_experts=self.warm_experts,
                        dtype=self.config.dtype, cache_format=self.config.cache, kernel_path=self.compute.path,
                        threads=kernels.threads if kernels is not None else torch.get_num_threads(),
                        decode_path=self.decode_path,
                        gemv_rows=counters.gemv_rows, expanded_experts=counters.expanded_experts,
                        expanded_dense=counters.expanded_dense, expand_from=self.compute.expand_from(),
                        peak_rss_bytes=peak_rss_bytes(), **timing)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, past=None, prefill: bool = True):
        self.state.prefill = prefill
        return self.model(ids.to(self.device), past_key_values=past, use_cache=past is not None or not prefill)

    @torch.no_grad()
    def window_states(self, window: torch.Tensor) -> torch.Tensor:
        """The final norm's outputs [L, H] of one window run as a prefill (a new sequence for the policy): what the
        head reads."""
        self.policy.begin_sequence()
        self.state.prefill = True
        states, _ = self._prefill(window[None], None, every=True)
        self.policy.end_prefill()
        return states

    @torch.no_grad()
    def window_nll(self, window: torch.Tensor) -> torch.Tensor:
        """Summed next-token NLL of one window scored as a prefill (a new sequence for the policy). The head is
        applied in vocabulary blocks (hexq.model.streaming.blocked_nll): no [positions, vocab] logits exist at once,
        in SCORING_DTYPE."""
        hidden = self.window_states(window)[:-1].to(SCORING_DTYPE)
        head = self.model.lm_head
        nll = blocked_nll(hidden, weight_rows(head), getattr(head, "bias", None), window[1:].to(self.device),
                          EXPAND_ROWS, SCORING_DTYPE)
        return nll.double().sum()

    def _prefill(self, ids: torch.Tensor, past, every: bool) -> tuple[torch.Tensor, object]:
        """(final norm's outputs, KV cache) of `ids` [1, L] after `past`, in forward passes of at most PREFILL_CHUNK
        tokens: every position's [L, H] (`every`), else a copy of the last one's [1, H] (on CPU, torch's linear takes
        a path ~100x slower for a [1, 1, H] view of a longer sequence: 6 s instead of 0.06 s for Qwen3-30B-A3B's
        151936 x 2048 head)."""
        kept = []
        for start in range(0, ids.shape[1], PREFILL_CHUNK):
            out = self.model.model(ids[:, start:start + PREFILL_CHUNK].to(self.device), past_key_values=past,
                                   use_cache=True)
            past = out.past_key_values
            return_freed_memory()
            kept.append(out.last_hidden_state[0] if every else out.last_hidden_state[0, -1:].clone())
        return (torch.cat(kept) if every else kept[-1]), past

    def _next_logits(self, ids: torch.Tensor, past) -> tuple[torch.Tensor, object]:
        """(float32 logits [vocab] at the last position, KV cache) of `ids` [1, L] after `past`. Every family's
        causal-LM head is one linear, applied to the last position alone."""
        last, past = self._prefill(ids, past, every=False)
        return self.model.lm_head(last)[0].float(), past

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids, as every generation entry point tokenizes it."""
        return self.tokenizer(prompt).input_ids

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A HexqError unless a prompt of `prompt_tokens` and `max_new_tokens` more fit the planned context."""
        if prompt_tokens == 0:
            raise HexqError("the prompt is empty")
        if prompt_tokens + max_new_tokens > self.plan.context:
            raise HexqError(f"prompt ({prompt_tokens} tokens) + {max_new_tokens} new tokens exceed the context of "
                            f"{self.plan.context} positions (--context)")

    @torch.no_grad()
    def tokens(self, ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY,
               steps: list[float] | None = None) -> Iterator[int]:
        """The continuation of the prompt `ids`, one token id at a time as each is chosen (sampling), ending after
        max_new_tokens or the end-of-sequence token (yielded too). One sequence for the policy; the decode step's
        seconds are appended to `steps`. Stopping the iteration early stops the computation."""
        self.check_length(len(ids), max_new_tokens)
        generator = sampling.generator()
        self.policy.begin_sequence()
        self.state.prefill = True
        prompt = self.native.prompt if self.native is not None else []
        held = self.native.k_cache.dtype if prompt else None
        self.reused = reusable_positions(prompt, ids, PREFILL_CHUNK) if exact_copy(self.dtype, held) else 0
        past = prefix_cache(self.native.k_cache, self.native.v_cache, self.reused, self.dtype,
                            self.model.config) if self.reused else None
        logits, past = self._next_logits(torch.tensor([ids[self.reused:]], device=self.device), past)
        self.policy.end_prefill()
        if self.native is not None:  # the prompt's KV cache moves into the native step's
            self.native.start(past, len(ids), len(ids) + max_new_tokens, self.reused)
            self.native.prompt = list(ids)
            past = None
        for index in range(max_new_tokens):
            token = next_token(logits, sampling, generator)
            yield token
            if token == self.tokenizer.eos_token_id or index == max_new_tokens - 1:
                return
            self.state.prefill = False
            step = time.perf_counter()
            if self.native is not None:
                logits = self.native.step(token)
            else:
                logits, past = self._next_logits(torch.tensor([[token]], device=self.device), past)
            if steps is not None:
                if self.device.type == "cuda":  # the step's queued work, not only its launches (the next token's
                    torch.cuda.synchronize(self.device)  # argmax waits for it anyway)
                steps.append(time.perf_counter() - step)

    def generate(self, prompt: str, max_new_tokens: int, on_text: Callable[[str], None] | None = None,
                 sampling: Sampling = GREEDY) -> tuple[str, RunStats]:
        """The continuation of `prompt` (see `tokens`), streamed through on_text, with the run's statistics."""
        ids = self.encode(prompt)
        started = time.perf_counter()
        if self.native is not None:
            self.native.profile()  # counted from here
        stream = TextStream(self.tokenizer)
        steps: list[float] = []  # seconds of each decode forward pass
        ttft = None
        for token in self.tokens(ids, max_new_tokens, sampling, steps):
            ttft = time.perf_counter() - started if ttft is None else ttft
            piece = stream.push(token)
            if on_text is not None and piece:
                on_text(piece)
        piece = stream.finish()
        if on_text is not None and piece:
            on_text(piece)
        total = time.perf_counter() - started
        # the median decode step: one scheduler hiccup on a shared machine should not move the figure
        tpot = statistics.median(steps) if steps else None
        profile = self.native.profile() if self.native is not None else None
        count = len(stream.tokens)
        return stream.text, self.stats(ttft_seconds=ttft, tpot_seconds=tpot, native_profile=profile,
                                       tokens_per_second=count / total if total > 0 else None,
                                       generated_tokens=count)


def compute_scratch_nbytes(artifact: Artifact, streamed, dtype: torch.dtype, torch_path: bool) -> int:
    """Scratch of hexq.runtime.compute: one expert expanded in the compute dtype and the largest quantized dense
    linear expanded (the paths taken where the cost model says so; a matrix taller than EXPAND_ROWS, a quantized head,
    a block of rows at a time), and without the kernels the torch path's code buffer for the larger of the two."""
    expert = [r * c for r, c in artifact.expert_shapes]
    quantized = artifact.quantized_linears
    shapes = [streamed.model.get_parameter(name).shape for name in quantized]
    dense = max((min(rows, EXPAND_ROWS) * cols for rows, cols in shapes), default=0)  # Compute.linear's blocks
    codes = max(*expert, dense) if torch_path else 0
    return (sum(expert) + dense) * dtype.itemsize + codes
