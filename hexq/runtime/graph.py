"""The CUDA decode step: a generated token as one fixed sequence of device kernels over a static KV cache, captured
once as a CUDA graph and replayed per token.

Why. On CUDA the transformers decoder runs a token as ~3,400 torch operator calls (docs/gpu.md), each microseconds of
Python and launch time, so the GPU waits on the host: 52-90 ms per token measured on an H100 for well under a
millisecond of kernels. A CUDA graph records the step's kernels once and replays them with one call. That needs a
step whose shapes and addresses never change and which never reads a device value on the host: the token and its
position are device tensors written before each replay; the KV cache is allocated for the sequence's positions and
attention covers all of them under a mask of the position; routing and the experts' table lookups stay on the device
(the layer's ExpertArena: one pair-GEMV launch per projection for its top-k experts, mixed widths together).

What it computes is the native CPU step's model (hexq.runtime.native; the families of hexq.runtime.coverage):
embedding row, per layer RMSNorm, q/k/v with the family's biases, q/k norms and clip, RoPE, the KV cache, attention,
o, the residual, RMSNorm, the router (softmax top-k, the family's renormalisation), the routed experts from their
codes with a skipped expert's weight given to the token's kept ones (hexq.model.simulate.served_weights), the
shared expert and its sigmoid gate or the dense MLP, the final norm and the head; activations in float32.
Matrices that read the same input are one launch where they share width, group size, layout and activation grid:
q/k/v, and gate/up of a shared expert or dense MLP, are laid end to end in one matrix (`fuse`), the modules' own
tensors becoming views into it (nothing is stored twice; the transformers path, which prefills, reads the same
bytes), and the input is put on the W8A8 grid once for all of them.

Where it runs: every expert resident in the device arena (the memory plan's `arena`: Triton, the static policy, room
for every expert). Off CUDA the same step runs eagerly - the tests, under Triton's CPU interpreter - which checks its
math, not its speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hexq.model.adapters import adapter_for
from hexq.packed.weight import CODE_PAD, PackedWeight
from hexq.runtime.compute import PackedLinear
from hexq.runtime.coverage import NotNative, routing_normalized, unsupported_model
from hexq.runtime.prefix import copy_prompt, grown_cache

WARMUP = 2  # eager steps before the capture: Triton compiles its kernels, the allocator settles


class Linear:
    """x [n, in] float32 -> [n, out] float32 in one launch: a packed matrix through the pair GEMV (which puts its
    input on the recipe's activation grid in the same launch), or a full-precision weight through torch's linear."""

    def __init__(self, weight: PackedWeight | torch.Tensor, quantizer, bias: torch.Tensor | None) -> None:
        self.weight, self.quantizer = weight, quantizer
        self.bias = None if bias is None else bias.detach().float()
        if isinstance(weight, PackedWeight):
            device = weight.codes.device
            self.table = torch.zeros(1, dtype=torch.int64, device=device)  # one matrix at offset 0 for every row
            self.bits = torch.full((1,), weight.bits, dtype=torch.int32, device=device)

    @classmethod
    def of(cls, module: torch.nn.Module) -> Linear:
        if isinstance(module, PackedLinear):
            return cls(module.weight_packed, module.quantizer, module.bias)
        return cls(module.weight.detach(), None, getattr(module, "bias", None))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, PackedWeight):
            # imported here, not with the module: importing triton costs ~1 s and ~100 MB a CPU-only run never uses
            from hexq.runtime.arena import linear_from_codes

            y = linear_from_codes(x, self.weight, self.quantizer, self.table, self.bits)  # W8A8 inside the launch
        else:
            y = F.linear(x.to(self.weight.dtype), self.weight).float()
        return y if self.bias is None else y + self.bias


def fuse(modules: list[torch.nn.Module]) -> Linear | None:
    """One Linear computing every module of `modules` (linears that read the same input) with their outputs end to
    end, or None where they cannot be one matrix (packed at different widths, group sizes, layouts or activation
    grids; packed beside full precision; different dtypes). The modules' own tensors become views into the fused
    ones, so the model keeps its size and its other readers (prefill) read the same bytes."""
    if all(isinstance(m, PackedLinear) for m in modules):
        first = modules[0]
        if any((m.bits, m.layout, m.scale.shape[-1], m.quantizer, m.in_features)
               != (first.bits, "stream", first.scale.shape[-1], first.quantizer, first.in_features)
               or m.out_features * m.in_features * m.bits % 8 for m in modules):
            return None
        lengths = [m.out_features * m.in_features * m.bits // 8 for m in modules]
        if any(m.codes.numel() < n + CODE_PAD for m, n in zip(modules, lengths, strict=True)):
            return None  # unpadded codes: not the Triton path's
        codes = torch.cat([m.codes[:n] for m, n in zip(modules, lengths, strict=True)]
                          + [torch.zeros(CODE_PAD, dtype=torch.uint8, device=first.codes.device)])
        scale, zero = torch.cat([m.scale for m in modules]), torch.cat([m.zero for m in modules])
        code_at = row_at = 0
        for m, n in zip(modules, lengths, strict=True):
            m.codes = codes[code_at:code_at + n + CODE_PAD]  # the pad: the next matrix's first bytes
            m.scale, m.zero = scale[row_at:row_at + m.out_features], zero[row_at:row_at + m.out_features]
            code_at, row_at = code_at + n, row_at + m.out_features
        weight = PackedWeight(codes, scale, zero, first.bits, (row_at, first.in_features))
        return Linear(weight, first.quantizer, _fused_bias(modules))
    if any(isinstance(m, PackedLinear) for m in modules) or len({m.weight.dtype for m in modules}) > 1:
        return None
    weight = torch.cat([m.weight.detach() for m in modules])
    row_at = 0
    for m in modules:
        m.weight = torch.nn.Parameter(weight[row_at:row_at + m.out_features], requires_grad=False)
        row_at += m.out_features
    return Linear(weight, None, _fused_bias(modules))


def _fused_bias(modules) -> torch.Tensor | None:
    biases = [getattr(m, "bias", None) for m in modules]
    present = [b for b in biases if b is not None]
    if not present:
        return None
    return torch.cat([b.detach().float() if b is not None else present[0].new_zeros(m.out_features, dtype=torch.float32)
                      for m, b in zip(modules, biases, strict=True)])


class Reads:
    """Linears that read one input, computed in one launch where `fuse` can make them one matrix, else one each;
    calling it returns their outputs in order."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.sizes = [m.out_features for m in modules]
        one = fuse(modules)
        self.linears = [one] if one is not None else [Linear.of(m) for m in modules]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.linears) == 1:
            return list(self.linears[0](x).split(self.sizes, dim=-1))
        return [linear(x) for linear in self.linears]


@dataclass
class Layer:
    """One decoder layer as the step reads it."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Reads
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_whole: bool  # olmoe: q/k normed over the whole projection, not per head
    router: torch.Tensor | None  # a MoE layer's router weight (full precision), else None
    experts: torch.nn.Module | None  # the layer's CachedExperts (its arena, activation function, quantizers)
    mlp: Reads | None  # gate and up of the shared expert (MoE layer) or the dense MLP
    down: Linear | None
    shared_gate: Linear | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [heads, D] at one position (the rotate-half convention of every covered family)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def graph_unsupported(runtime) -> None:
    """Raise NotNative naming why `runtime` decodes through the transformers model instead of this step."""
    unsupported_model(runtime)
    if not runtime.plan.arena:
        raise NotNative("the experts are not all resident in the device arena")


class GraphDecoder:
    """The CUDA graph step over a built Runtime (see the module docstring), with the native step's interface:
    `start` a sequence from the transformers path's prefill, then `step` per token."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.device = runtime.device
        self.captures = runtime.device.type == "cuda"
        self.path = "cuda graph" if self.captures else "static step (eager off CUDA)"
        config = runtime.model.config
        base = runtime.model.model
        first = base.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, \
            first.head_dim
        self.top_k, self.normalize = config.num_experts_per_tok, routing_normalized(config)
        self.eps, self.scaling = float(base.norm.variance_epsilon), float(first.scaling)
        self.window = getattr(first, "sliding_window", None) or 0
        self.clip = getattr(config, "clip_qkv", None)
        self.inv_freq = base.rotary_emb.inv_freq.detach().float()
        self.rope_scaling = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.embed = base.embed_tokens.weight.detach()
        self.final_norm = base.norm.weight.detach().float()
        self.head = Linear.of(runtime.model.lm_head)
        self.layers = [self._layer(index, layer, adapter_for(config.model_type))
                       for index, layer in enumerate(base.layers)]
        self.token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.position = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(config.vocab_size, dtype=torch.float32, device=self.device)
        self.capacity = self.positions = 0
        self.prompt: list[int] = []  # the prompt whose prefill's keys and values the cache holds (Runtime.tokens)
        self.graph = None

    @classmethod
    def of(cls, runtime) -> GraphDecoder:
        graph_unsupported(runtime)
        return cls(runtime)

    def _layer(self, index: int, layer: torch.nn.Module, adapter) -> Layer:
        attn = getattr(layer, adapter.attention)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        block = getattr(layer, adapter.moe)
        experts = router = gate = None
        mlp = block
        if index in self.runtime.artifact.moe_layers:
            router = getattr(block, adapter.router).weight.detach()
            experts = getattr(block, adapter.experts)
            mlp = getattr(block, adapter.shared_expert) if adapter.shared_expert else None
            if adapter.shared_expert_gate:
                gate = Linear.of(getattr(block, adapter.shared_expert_gate))
        return Layer(
            input_norm=getattr(layer, adapter.input_norm).weight.detach().float(),
            post_norm=getattr(layer, adapter.post_attention_norm).weight.detach().float(),
            qkv=Reads([attn.q_proj, attn.k_proj, attn.v_proj]), o=Linear.of(attn.o_proj),
            q_norm=None if q_norm is None else q_norm.weight.detach().float(),
            k_norm=None if k_norm is None else k_norm.weight.detach().float(),
            qk_whole=q_norm is not None and q_norm.weight.numel() != self.head_dim,
            router=router, experts=experts,
            mlp=None if mlp is None else Reads([mlp.gate_proj, mlp.up_proj]),
            down=None if mlp is None else Linear.of(mlp.down_proj), shared_gate=gate)

    # --- the step

    def _attention(self, index: int, layer: Layer, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q, k, v = layer.qkv(h)
        if layer.qk_whole:
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(heads, dim), k.view(kv_heads, dim), v.view(kv_heads, dim)
        if layer.q_norm is not None and not layer.qk_whole:
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        keys, values = self.k_cache[index], self.v_cache[index]  # [kv_heads, capacity, D]
        keys.index_copy_(1, self.position, k[:, None])
        values.index_copy_(1, self.position, v[:, None])
        scores = q.view(kv_heads, heads // kv_heads, dim) @ keys.transpose(1, 2) * self.scaling
        seen = self.slots <= self.position
        if self.window:
            seen = seen & (self.slots > self.position - self.window)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        return layer.o((probs @ values).reshape(1, heads * dim))

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.mlp(h)
        return layer.down(F.silu(gate) * up)

    def _moe(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h.to(layer.router.dtype), layer.router)
        weights, index = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts = layer.experts
        y = experts.arena(h, index, weights, experts.act_fn, experts.quantizers).float()
        if layer.mlp is not None:
            shared = self._mlp(layer, h)
            if layer.shared_gate is not None:
                shared = torch.sigmoid(layer.shared_gate(h)) * shared
            y = y + shared
        return y

    def _forward(self) -> None:
        """One token: self.token at self.position in, self.logits out, its keys and values into the cache."""
        x = self.embed.index_select(0, self.token).float()  # [1, H]
        freqs = self.position.float()[:, None] * self.inv_freq[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer, rms_norm(x, layer.input_norm, self.eps), cos, sin)
            h = rms_norm(x, layer.post_norm, self.eps)
            x = x + (self._moe(layer, h) if layer.router is not None else self._mlp(layer, h))
        self.logits.copy_(self.head(rms_norm(x, self.final_norm, self.eps))[0])

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The step recorded as a CUDA graph, after WARMUP eager steps on a side stream (the warm-up computes the
        current token at the current position, which the replay computes again; the skipped-slot counts it adds are
        taken back)."""
        counts = [layer.experts.arena.skipped.clone() for layer in self.layers if layer.experts is not None]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward()
        for layer, count in zip((lay for lay in self.layers if lay.experts is not None), counts, strict=True):
            layer.experts.arena.skipped.copy_(count)
        return graph

    # --- serving

    def start(self, past, positions: int, capacity: int, first: int = 0) -> None:
        """A new sequence whose first `positions` tokens the transformers path prefilled into `past` (its KV cache):
        room for `capacity` positions, the prompt's keys and values from position `first` on copied in as float32
        (those before it are the previous prompt's, kept: hexq.runtime.prefix). A larger capacity than before
        allocates the cache again and captures anew, rounded up to a power of two (at most the memory plan's
        context), so a server's growing requests capture a handful of times, not once per length."""
        self.prompt = []  # the caller names the new prompt once its keys and values are in
        if capacity > self.capacity:
            capacity = max(capacity, min(1 << max(6, (capacity - 1).bit_length()), self.runtime.plan.context))
            shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
            old_k, old_v = (self.k_cache, self.v_cache) if first else (None, None)
            self.k_cache = grown_cache(old_k, shape, torch.float32, self.device, first)
            self.v_cache = grown_cache(old_v, shape, torch.float32, self.device, first)
            self.slots = torch.arange(capacity, device=self.device)
            self.capacity, self.graph = capacity, None
        copy_prompt(self.k_cache, self.v_cache, past, first, positions)
        self.positions = positions

    def step(self, token: int) -> torch.Tensor:
        """Logits [vocab] float32 of `token` at the next position (its keys and values join the cache)."""
        if self.positions >= self.capacity:
            raise ValueError(f"the step's KV cache holds {self.capacity} positions")
        self.token.fill_(token)
        self.position.fill_(self.positions)
        if self.captures and self.graph is None:
            try:
                self.graph = self._capture()
            except RuntimeError as exc:  # a driver or library that refuses the capture: the same step, eagerly
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.captures = False
                reason = (str(exc).splitlines() or ["no message"])[0]
                self.path = self.runtime.decode_path = f"static step (the CUDA graph capture failed: {reason})"
        if self.captures:
            self.graph.replay()
        else:
            self._forward()
        self.positions += 1
        return self.logits.clone()

    def profile(self) -> None:
        """No per-phase profile: a replayed graph has no host-side phases to time (`--stats` gives TPOT)."""
        return None
