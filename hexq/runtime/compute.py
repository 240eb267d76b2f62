"""How `hexq run` computes with packed weights: a layer's routed experts and the quantized dense linears, straight
from their codes.

Two ways to compute a packed matrix on n tokens (003 §III.C.1, eq. 7-8, with the fill being an expansion):
  GEMV     from the codes (hexq.packed.cpu; on CUDA hexq.packed.triton): reads the packed bytes once per 4 tokens,
           costs n * lat_slow;
  expand   dequantize into a scratch matrix in the compute dtype, then the BLAS product: T_e + n * lat_fast.
`should_fill(n, profile)` picks per expert and per forward pass, with the latencies measured at start-up on this
machine (`measure_profiles`): decode (n = 1) runs from the codes, a prefill expands the experts that got many tokens.
Without the kernels (no C compiler, or a device they do not cover) every matrix is expanded, with the torch
dequantization.

A layer's experts go through two kernel calls (all gate_up products, then all down products) with the activation in
between, whatever the widths: `ExpertBatch` gathers the routed tokens once, sorted by (expert, width), so each
expert's tokens are one contiguous block of rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hexq.base.errors import HexqError
from hexq.base.io import cache_dir, write_json_atomic
from hexq.model.simulate import quantized_expert_output
from hexq.packed.bitpack import DequantScratch
from hexq.packed.cpu import SOURCE, GemvJob, gemv_takes, load_cpu_kernels
from hexq.packed.weight import PackedWeight, dequantize_packed_into, zeros_as_laid
from hexq.runtime import cost
from hexq.runtime.cache import ExpertWeights
from hexq.runtime.cost import LatencyProfile, measure_latency, n_critical, should_fill

# Rows of a dense packed matrix expanded at once (the scratch "dense"): every layer linear whole, a quantized head
# ([vocab, hidden]: 151,936 rows at Qwen3-30B-A3B's vocabulary) a block at a time, in a decode step and in a
# perplexity pass alike (PackedRows).
EXPAND_ROWS = 16384
# Routed rows computed from the codes at a time (Compute._experts_from_codes): their float32 input copies and
# intermediates are what a prefill pass holds beside its per-token activations (hexq.runtime.memory).
FROM_CODES_ROWS = 512
# The dtype `hexq run --ppl` and `--kl-against` score the head in, whatever --dtype: float32, as `hexq eval` scores
# (bf16 logits moved the served perplexity by ~0.01%).
SCORING_DTYPE = torch.float32

WIDTH_SLOTS = 16  # sort key stride: expert * 16 + (8 - bits) puts an expert's highest width first
# The cost model's timing runs: the GEMV on one slice of its tokens (the kernel takes 4 at a time), the expanded
# product on as many tokens as a prefill gives an expert that has many (its per-token cost falls until the product's
# fixed cost is amortised).
GEMV_TOKENS, EXPAND_TOKENS = 4, 64
# A measured profile is kept under a key naming the kernels' source and the cost model's (how it is measured).
COST_SOURCE = Path(cost.__file__)


@dataclass
class Route:
    """One layer's routed (token, slot) pairs grouped by (expert, width), experts ascending, widths descending:
    rows [start, start + count) of the gathered tokens belong to groups[i] = (expert, bits, start, count)."""

    tokens: torch.Tensor  # [N] token of each gathered row
    slots: torch.Tensor  # [N] its top-k slot
    groups: list[tuple[int, int, int, int]]
    skipped: int  # (token, slot) pairs whose width is 0 (the expert is skipped)


def route(top_k_index: torch.Tensor, bits: torch.Tensor, num_experts: int) -> Route:
    """The grouping of `Route` from one sort on the routing's device and one copy of the group sizes to the host
    (whatever the number of experts). Slots with ids outside [0, E) (dropped by the family) are left out."""
    k = top_k_index.shape[-1]
    experts, widths = top_k_index.reshape(-1).long(), bits.reshape(-1).long()
    valid = (experts >= 0) & (experts < num_experts)
    kept = valid & (widths > 0)
    beyond = num_experts * WIDTH_SLOTS
    key = torch.where(kept, experts * WIDTH_SLOTS + (8 - widths), torch.where(valid, beyond, beyond + 1))
    order = torch.argsort(key, stable=True)
    values, counts = torch.unique_consecutive(key[order], return_counts=True)
    groups, start, skipped, kept_rows = [], 0, 0, 0
    for value, count in torch.stack([values, counts]).T.tolist():
        if value < beyond:
            groups.append((value // WIDTH_SLOTS, 8 - value % WIDTH_SLOTS, start, count))
            kept_rows += count
        elif value == beyond:
            skipped = count
        start += count
    positions = order[:kept_rows]
    return Route(positions // k, positions % k, groups, skipped)


@dataclass
class Profiles:
    """The cost model's measured latencies: for a routed expert and for the largest quantized dense linear."""

    expert: LatencyProfile | None = None
    dense: LatencyProfile | None = None


@dataclass
class Counters:
    """What the compute did: rows computed from the codes, experts and dense products expanded."""

    gemv_rows: int = 0
    expanded_experts: int = 0
    expanded_dense: int = 0


class Compute:
    """The runtime's way of computing packed weights on one device (see the module docstring).

    kernels: hexq.packed.cpu.CpuKernels (CPU) or None (expand everything); dtype: the compute dtype of expanded
    matrices and of the dense part; act_fn and the experts' activation quantizers come per layer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, kernels=None, triton: bool = False) -> None:
        self.device, self.dtype, self.kernels, self.triton = device, dtype, kernels, triton
        self.profiles = Profiles()
        self.counters = Counters()
        self._local = threading.local()

    @property
    def path(self) -> str:
        """The CPU kernels' path ('avx512', 'avx2', 'scalar'), 'triton', or 'torch' when every matrix is expanded."""
        return self.kernels.path if self.kernels is not None else "triton" if self.triton else "torch"

    def expand_from(self) -> dict[str, float | None]:
        """The token count from which each kind of matrix is expanded (003 eq. 7-8's n_critical): 0 when everything
        is expanded (no kernels), None when nothing is (n_critical infinite, or Triton computing everything from the
        codes)."""
        if self.kernels is None and not self.triton:
            return {"expert": 0.0, "dense": 0.0}
        out = {}
        for kind, profile in (("expert", self.profiles.expert), ("dense", self.profiles.dense)):
            crossing = None if profile is None else n_critical(profile)
            out[kind] = None if crossing is None or math.isinf(crossing) else round(crossing, 1)
        return out

    # --- scratch

    def _expanded(self, key: str, shape: tuple[int, int]) -> torch.Tensor:
        """The calling thread's scratch matrix `key` of at least `shape`'s size in the compute dtype."""
        buffers = self._local.__dict__.setdefault("buffers", {})
        numel = shape[0] * shape[1]
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = buffers[key] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return buffer[:numel].view(shape)

    def expand(self, weight: PackedWeight, key: str) -> torch.Tensor:
        """The packed matrix dequantized into the calling thread's scratch `key` (valid until its next use)."""
        out = self._expanded(key, weight.shape)
        if self.kernels is None or not self.kernels.dequantize(out, weight):
            codes = self._local.__dict__.get("codes")
            if codes is None or codes.buffer.numel() < DequantScratch.nbytes_for(out.numel()):
                codes = self._local.codes = DequantScratch(out.numel(), self.device)
            dequantize_packed_into(out, weight, codes)
        return out

    # --- which way

    def _from_codes(self, weights: tuple[PackedWeight, ...], tokens: int, profile: LatencyProfile | None) -> bool:
        if self.kernels is None:
            return False
        if not all(gemv_takes(w.shape, w.bits, w.scale.shape[-1], self.kernels.path) for w in weights):
            return False
        return profile is None or not should_fill(tokens, profile)

    # --- dense linears

    def linear(self, x: torch.Tensor, weight: PackedWeight, quantizer=None) -> torch.Tensor:
        """Q(x) [n, in] @ W^T for a packed W [out, in], in x's dtype, Q the recipe's activation quantizer of the
        linear's input (an ActQuantizer, or None: none)."""
        if self.triton:  # every row of x a pair on the one matrix (its codes padded: hexq.runtime.model)
            # imported only where Triton computes: importing triton takes ~1 s
            from hexq.runtime.arena import linear_from_codes

            zero = torch.zeros(1, dtype=torch.int64, device=x.device)
            bits = torch.full((1,), weight.bits, dtype=torch.int32, device=x.device)
            self.counters.gemv_rows += x.shape[0]
            return linear_from_codes(x, weight, quantizer, zero, bits).to(x.dtype)
        # quantized in float32, as `hexq eval` and the native step quantize: in bf16 arithmetic the grid's scale and
        # the rounding put some activations on another code
        rows = x if quantizer is None else quantizer(x.float())
        if self._from_codes((weight,), x.shape[0], self.profiles.dense):
            y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
            self.kernels.gemv([GemvJob(weight, rows.float().contiguous(), y)])
            self.counters.gemv_rows += x.shape[0]
            return y.to(x.dtype)
        self.counters.expanded_dense += 1
        rows = rows.to(self.dtype)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, weight.shape[0], EXPAND_ROWS):
            block = self.expand(weight.rows(start, start + EXPAND_ROWS), "dense")
            out[:, start:start + block.shape[0]] = torch.nn.functional.linear(rows, block)
        return out

    # --- routed experts

    def expert(self, x: torch.Tensor, weights: ExpertWeights, act_fn, quantizers) -> torch.Tensor:
        """One expert on its rows x [n, H] -> [n, H] float32 (a group computed on its own: a transient load)."""
        y = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        self.experts(x, [(weights, 0, x.shape[0])], y, act_fn, quantizers)
        return y

    def experts(self, x: torch.Tensor, batch: list[tuple[ExpertWeights, int, int]], y: torch.Tensor, act_fn,
                quantizers) -> None:
        """y[rows] for every (weights, start, count) of `batch`: the experts on their rows of x [N, H] (rows of one
        expert contiguous). Those computed from the codes share two kernel calls; the others are expanded (or are
        expanded already: a bf16/fp32 cache) and computed one by one."""
        input_quant, mid_quant = quantizers
        chosen = [w.packed and self._from_codes((w.gate_up, w.down), n, self.profiles.expert) for w, _, n in batch]
        from_codes = [item for item, codes in zip(batch, chosen, strict=True) if codes]
        for (weights, start, count), codes in zip(batch, chosen, strict=True):
            if codes:
                continue
            rows = x[start:start + count]
            if weights.packed:
                self.counters.expanded_experts += 1
                gate_up, down = self.expand(weights.gate_up, "gate_up"), self.expand(weights.down, "down")
            else:
                gate_up, down = weights.gate_up, weights.down
            y[start:start + count] = quantized_expert_output(rows.to(gate_up.dtype), gate_up, down, act_fn,
                                                             input_quant, mid_quant)
        if from_codes:
            self._experts_from_codes(x, from_codes, y, act_fn, input_quant, mid_quant)

    def _experts_from_codes(self, x, batch, y, act_fn, input_quant, mid_quant) -> None:
        """The batch's experts from their codes, FROM_CODES_ROWS routed rows at a time (every step is row by row:
        the activations are quantized per token or on a static range), so a prefill pass's float32 copies of its
        rows and their intermediates stay that size however many tokens it routes."""
        jobs = sorted((s, n, w) for w, s, n in batch)
        for first in range(0, sum(n for _, n, _ in jobs), FROM_CODES_ROWS):
            window, taken = [], 0
            for start, count, weights in jobs:  # the rows [first, first + FROM_CODES_ROWS) of the batch's rows
                lo, hi = max(first - taken, 0), min(first + FROM_CODES_ROWS - taken, count)
                if lo < hi:
                    window.append((weights, start + lo, hi - lo))
                taken += count
            self._window_from_codes(x, window, y, act_fn, input_quant, mid_quant)
        self.counters.gemv_rows += sum(n for _, _, n in batch)

    def _window_from_codes(self, x, batch, y, act_fn, input_quant, mid_quant) -> None:
        offsets = [0]
        for _, _, n in batch:
            offsets.append(offsets[-1] + n)
        rows = torch.empty(offsets[-1], x.shape[1], dtype=torch.float32, device=x.device)
        for (_, s, n), o in zip(batch, offsets, strict=False):
            rows[o:o + n] = x[s:s + n]
        if input_quant is not None:
            rows = input_quant(rows).contiguous()
        inner = batch[0][0].gate_up.shape[0]
        hidden = torch.empty(rows.shape[0], inner, dtype=torch.float32, device=x.device)
        self.kernels.gemv([GemvJob(w.gate_up, rows[o:o + n], hidden[o:o + n])
                           for (w, _, n), o in zip(batch, offsets, strict=False)])
        gate, up = hidden.chunk(2, dim=-1)
        mid = act_fn(gate).mul_(up)
        if mid_quant is not None:
            mid = mid_quant(mid)
        mid = mid.contiguous()
        self.kernels.gemv([GemvJob(w.down, mid[o:o + n], y[s:s + n])
                           for (w, s, n), o in zip(batch, offsets, strict=False)])

    def relaid(self, weights: ExpertWeights) -> ExpertWeights:
        """An expert re-laid in place for the kernels (hexq.packed.cpu `relayout`: rows8 on the SIMD paths, planes
        on the portable one; the same bytes, read 1.5-2x faster than the stored stream): a cache-resident one once,
        under the cache's lock (ExpertCache.relayout), by the first forward pass or native step that computes it; a
        transient one in its loader's buffer, at each load."""
        return dataclasses.replace(weights, gate_up=self.kernels.relayout(weights.gate_up),
                                   down=self.kernels.relayout(weights.down))

    def lays_out(self, weights: ExpertWeights) -> bool:
        """Whether `relaid` would change `weights` (packed codes the kernels read faster in another layout)."""
        return (self.kernels is not None and weights.packed
                and any(self.kernels.layout_for(w) != w.layout for w in (weights.gate_up, weights.down)))

    # --- start-up measurements

    def measure(self, expert: ExpertWeights | None, dense: PackedWeight | None, act_fn) -> None:
        """The cost model's latencies on this machine (003 §III.C.1 "online calibration"): computing one expert
        (and the largest dense linear) from the codes against expanding it, timed on a few tokens. Measured once per
        machine, shapes, widths, dtype and threads, and kept in hexq's cache folder: every later run makes the same
        choices, so its numbers are reproducible (a fresh measurement could move a threshold by a token)."""
        if self.kernels is None:
            return
        if expert is not None and expert.packed and self._from_codes((expert.gate_up, expert.down), 1, None):
            self.profiles.expert = cached_profile(self._profile_key("expert", expert.gate_up, expert.down),
                                                  lambda: self._measure_expert(expert, act_fn))
        if dense is not None and self._from_codes((dense,), 1, None):
            self.profiles.dense = cached_profile(self._profile_key("dense", dense),
                                                 lambda: self._measure_dense(dense))
        self.counters = Counters()

    def _profile_key(self, kind: str, *weights: PackedWeight) -> str:
        shapes = ",".join(f"{w.shape[0]}x{w.shape[1]}b{w.bits}g{w.scale.shape[-1]}" for w in weights)
        return (f"{kind}-{shapes}-{str(self.dtype).removeprefix('torch.')}-{self.kernels.path}-t{self.kernels.threads}"
                f"-{hashlib.sha256(SOURCE.read_bytes() + COST_SOURCE.read_bytes()).hexdigest()[:8]}")

    def _measure_expert(self, expert: ExpertWeights, act_fn) -> LatencyProfile:
        hidden = expert.down.shape[0]

        def slow(n: int) -> None:
            self._experts_from_codes(torch.randn(n, hidden, device=self.device), [(expert, 0, n)],
                                     torch.empty(n, hidden, device=self.device), act_fn, None, None)

        def fast(n: int) -> None:
            quantized_expert_output(torch.randn(n, hidden, device=self.device, dtype=self.dtype),
                                    self._expanded("gate_up", expert.gate_up.shape),
                                    self._expanded("down", expert.down.shape), act_fn, None, None)

        def fill() -> None:
            self.expand(expert.gate_up, "gate_up")
            self.expand(expert.down, "down")

        expert = self.relaid(expert)  # a transient copy, timed in the layout the cache serves (`relaid`)
        fill()  # the expanded scratch holds real weights while `fast` is timed
        return measure_latency(slow, fast, fill, n_tokens=GEMV_TOKENS, fast_tokens=EXPAND_TOKENS)

    def _measure_dense(self, dense: PackedWeight) -> LatencyProfile:
        def slow(n: int) -> None:
            self.linear(torch.randn(n, dense.shape[1], device=self.device), dense)

        def fast(n: int) -> None:
            torch.nn.functional.linear(torch.randn(n, dense.shape[1], device=self.device, dtype=self.dtype),
                                       self._expanded("dense", dense.shape))

        self.expand(dense, "dense")
        return measure_latency(slow, fast, lambda: self.expand(dense, "dense"), n_tokens=GEMV_TOKENS,
                               fast_tokens=EXPAND_TOKENS)


def cached_profile(key: str, measure) -> LatencyProfile:
    """The LatencyProfile stored under `key` in hexq's cache folder, or measure() written there (atomically)."""
    path = cache_dir() / "profiles" / f"{key}.json"
    try:
        return LatencyProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    profile = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, asdict(profile))
    except OSError:  # a read-only cache folder: measured again next time
        pass
    return profile


class PackedLinear(torch.nn.Module):
    """A quantized dense linear served from its packed weight: the recipe's activation quantization (if any) on the
    input, then Compute.linear; bias added in the compute dtype. Stands in for the nn.Linear of the same name; the
    codes, scale and zero are its (non-persistent) buffers, so the model's memory counts them."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, quantizer, compute: Compute) -> None:
        super().__init__()
        self.register_buffer("codes", weight.codes, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("zero", weight.zero, persistent=False)
        self.bits, self.layout, self.quantizer, self.compute = weight.bits, weight.layout, quantizer, compute
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    @property
    def weight_packed(self) -> PackedWeight:
        return PackedWeight(self.codes, self.scale, zeros_as_laid(self.zero, self.layout), self.bits,
                            (self.out_features, self.in_features), self.layout)

    def relayout(self, kernels) -> PackedWeight:
        """Its codes re-laid in place for the CPU kernels (hexq.packed.cpu.CpuKernels.relayout); the new weight."""
        weight = kernels.relayout(self.weight_packed)
        self.layout = weight.layout
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.compute.linear(x.reshape(-1, x.shape[-1]), self.weight_packed, self.quantizer)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class PackedRows:
    """A PackedLinear's weight read a block of rows at a time: `rows[start:stop]` is those rows dequantized in the
    compute dtype (valid until the next block is read), so code that upcasts a head a block of vocabulary rows at a
    time (hexq.model.streaming.blocked_nll, hexq.eval.divergence.head_logits) reads a packed head the same way, never
    expanding all of it."""

    def __init__(self, linear: PackedLinear) -> None:
        self.linear = linear
        self.shape = (linear.out_features, linear.in_features)
        self.device = linear.codes.device

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _step = rows.indices(self.shape[0])
        return self.linear.compute.expand(self.linear.weight_packed.rows(start, stop), "dense")


def weight_rows(linear: torch.nn.Module):
    """What blocked_nll / head_logits read a linear's weight from: its weight, or a PackedLinear's PackedRows."""
    return PackedRows(linear) if isinstance(linear, PackedLinear) else linear.weight


def compute_backend(kernels: str, device: torch.device, threads: int | None):
    """(CPU kernels or None, whether Triton computes) for --kernels on `device` (see RuntimeConfig)."""
    if kernels == "torch":
        return None, False
    if kernels == "triton" or kernels == "auto" and device.type == "cuda":
        from hexq.packed import triton as gpu  # only here: importing triton takes ~1 s and ~100 MB a CPU run never uses

        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if gpu.available() and (device.type == "cuda" or interpreted):
            return None, True
        if kernels == "triton":
            raise HexqError("--kernels triton needs the triton package and a CUDA device (or TRITON_INTERPRET=1)")
        return None, False
    if device.type != "cpu":
        raise HexqError(f"--kernels cpu computes on the CPU; with --device {device} use --kernels auto")
    cpu = load_cpu_kernels(threads=threads)
    if cpu is None and kernels == "cpu":
        raise HexqError("--kernels cpu: the CPU kernels could not be built (no C compiler?); use --kernels torch")
    return cpu, False
