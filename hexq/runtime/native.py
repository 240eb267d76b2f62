"""The native decode step: one call into hexq/packed/decode.c per generated token, with no Python and no torch op
between the layers.

Why. A decode step through the transformers model is a Python program of a few hundred torch ops and ~6 kernel
calls per layer, each waking the kernels' thread pool: on a real-shaped layer that costs more than the kernels. The
native step runs a whole token - embedding row, per layer RMSNorm, q/k/v (the family's q/k norms and biases), RoPE,
the KV cache, attention, o, the router (softmax top-k and the family's renormalisation), the routed experts at their
served widths from their packed codes (every kept expert's gate_up in one pool phase, their down products in a
second), the shared expert or dense MLP, the weighted sum; the final norm and the head - in one threaded region
whose workers spin between phases (kernels.c `parallel`, `pool_hot`). Activations are float32 throughout; a packed
matrix's input is put on the recipe's activation grid (W8A8) once and quantized into int16 blocks once, shared by
every matrix that reads it.

What it covers (`unsupported`, one place, says why a runtime does not take it; `--stats` names the path): the
families whose decoder is GQA attention + softmax-top-k routed experts (qwen3_moe, qwen2_moe, olmoe, mixtral), with
SiLU experts and a RoPE whose frequencies do not depend on the sequence length, served on the CPU kernels from the
packed cache at the static allocation (`hexq run --policy static`), with a fast tier that holds at least one layer's
top-k experts. Everything else - the dynamic policies, deepseek's MLA, phimoe, Triton - keeps the transformers path.

Under a fast tier smaller than the experts (`--memory`, `--fast-tier`) the step cannot hold every expert: each layer's
table starts with its experts absent, and a token routed to an absent one stops the step after that layer's routing
(decode.c hexq_resume). Python then loads the layer's absent experts through the cache - the layer's kept experts
pinned, LRU eviction - re-lays them, writes them into the table, and the step resumes from that layer's expert
products: Python runs only where a load has to happen anyway. The cache tells the decoder of every eviction
(ExpertCache.watch), which makes that entry absent before its memory is reused, and the step logs the resident
experts it served, handed to the cache as hits that refresh their recency (ExpertCache.touch). No background load
runs while the step does; the step reads ahead instead (decode.c read_ahead: a layer's misses, and the next layer's
predicted experts, handed to the kernel's page cache before Python loads any). The misses skip the admission cost
model: a transient load would leave a table entry pointing at scratch the next load reuses. The prompt is prefilled
by the transformers path and its KV cache copied into the native one (after the previous prompt's positions it
begins with, where it reuses them: hexq.runtime.prefix).

The weights are the model's own tensors (no copy, except the norms' float32 weights: a few KB per layer); the
experts are the cache's resident packed versions, pinned for the decoder's lifetime where all of them fit. Both are
re-laid in place into the kernels' layout when the decoder is built (hexq.packed.cpu `relayout`: rows8 on the SIMD
paths, planes on the portable one, the same bytes read faster; under a small fast tier, each expert when it is
loaded); the transformers path reads the re-laid codes through the same kernels (prefill).
"""

from __future__ import annotations

import ctypes

import torch

from hexq.model.adapters import adapter_for
from hexq.packed.cpu import gemv_takes
from hexq.packed.weight import LAYOUTS
from hexq.runtime.compute import PackedLinear
from hexq.runtime.coverage import NotNative, routing_normalized, unsupported_model
from hexq.runtime.prefix import copy_prompt, grown_cache
from hexq.runtime.residency import ExpertWeights

MAT_NONE, MAT_PACKED, MAT_F32, MAT_BF16, MAT_ABSENT = 0, 1, 2, 3, 4
QK_NONE, QK_HEAD, QK_WHOLE = 0, 1, 2
# decode.c's fixed arrays (MAX_GROUP: query heads per KV head; MAX_HEAD_DIM: a float16 cache row converted on the stack)
MAX_TOP_K, MAX_EXPERTS, MAX_GROUP, MAX_HEAD_DIM = 64, 1024, 64, 1024
# The native step's KV cache (`hexq run --kv-cache`): float16 by default, as llama.cpp's (half the memory, and of what
# attention reads at long context; keys and values rounded to 11 significant bits), or float32.
KV_CACHES = {"f16": torch.float16, "f32": torch.float32}
AHEAD_RANGES = 4  # decode.c: byte ranges per expert it can read ahead


class Act(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("symmetric", ctypes.c_int32), ("dynamic", ctypes.c_int32),
                ("low", ctypes.c_float), ("high", ctypes.c_float)]


class Matrix(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("bits", ctypes.c_int32), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("group", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("act", Act),
                ("layout", ctypes.c_int32)]


class Expert(ctypes.Structure):
    _fields_ = [("gate_up", Matrix), ("down", Matrix)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q", Matrix), ("k", Matrix),
                ("v", Matrix), ("o", Matrix), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qk_norm", ctypes.c_int32), ("moe", ctypes.c_int32), ("router", Matrix),
                ("experts", ctypes.c_void_p), ("mlp_gate", Matrix), ("mlp_up", Matrix), ("mlp_down", Matrix),
                ("shared_gate", Matrix), ("ahead_fd", ctypes.c_int32), ("ahead", ctypes.c_void_p)]


class Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("vocab", ctypes.c_int32),
                ("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32), ("normalize", ctypes.c_int32),
                ("inter", ctypes.c_int32), ("mlp_inter", ctypes.c_int32), ("sliding_window", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("rope_scaling", ctypes.c_float),
                ("clip_qkv", ctypes.c_float), ("inv_freq", ctypes.c_void_p), ("embed_kind", ctypes.c_int32),
                ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", Matrix),
                ("layer", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("max_pos", ctypes.c_int64), ("kv_half", ctypes.c_int32)]


class Resume(ctypes.Structure):
    """decode.c hexq_resume: where a step stopped for absent experts, and the log of the resident ones it served."""
    _fields_ = [("layer", ctypes.c_int32), ("n", ctypes.c_int32), ("ids", ctypes.c_int32 * MAX_TOP_K),
                ("weights", ctypes.c_float * MAX_TOP_K), ("log", ctypes.c_void_p), ("logged", ctypes.c_int32)]


def _act(quantizer) -> Act:
    if quantizer is None:
        return Act(0, 0, 0, 0.0, 0.0)
    return Act(quantizer.bits, int(quantizer.symmetric), int(quantizer.dynamic), quantizer.low, quantizer.high)


class NativeDecoder:
    """The native step over a built Runtime (see the module docstring). Build it with `NativeDecoder.of(runtime)`,
    which raises NotNative with the reason when the runtime is not covered."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.path = "native"  # what --stats names
        self.kernels = runtime.compute.kernels
        self.library = self.kernels.library
        self.library.hexq_decode.restype = ctypes.c_int
        self.library.hexq_decode.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.library.hexq_decode_profile.argtypes = [ctypes.c_void_p]
        self.library.hexq_decode_scratch.restype = ctypes.c_int64
        self.library.hexq_decode_scratch.argtypes = [ctypes.c_void_p]
        self._keep: list = []  # every tensor and ctypes array the C structs point into
        # A fast tier smaller than the experts: the tables start empty and follow the cache (see `_load_absent`)
        self.loads = not runtime.plan.holds_every_expert
        self._tables: dict[int, tuple] = {}  # MoE row -> (its Expert table, the experts' input and mid quantizers)
        self._held: dict[tuple[int, int], ExpertWeights] = {}  # (row, expert) -> the weights its table entry reads
        self._rows = {layer: row for row, layer in enumerate(runtime.artifact.moe_layers)}
        self.model = self._describe()  # its max_pos: the KV cache's positions (0 until `start`)
        self.positions = 0  # tokens in the KV cache
        self.prompt: list[int] = []  # the prompt whose prefill's keys and values the cache holds (Runtime.tokens)
        self.resume = Resume()  # its log (of the experts served from the tables) only where the cache reads it
        if self.loads:
            self._log = (ctypes.c_int32 * (self.model.layers * self.model.top_k))()
            self.resume.log = ctypes.addressof(self._log)
            runtime.cache.watch(self._gone)

    @classmethod
    def of(cls, runtime) -> NativeDecoder:
        unsupported(runtime)
        return cls(runtime)

    # --- describing the model to C

    def _tensor(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _float32(self, tensor: torch.Tensor | None) -> int | None:
        return None if tensor is None else self._tensor(tensor.detach().float())

    def _matrix(self, module) -> Matrix:
        if module is None:
            return Matrix()
        if isinstance(module, PackedLinear):
            return self._packed(module.relayout(self.kernels), module.quantizer, module.bias)
        weight = module.weight
        kind = {torch.float32: MAT_F32, torch.bfloat16: MAT_BF16}.get(weight.dtype)
        if kind is None:
            raise NotNative(f"a {weight.dtype} linear")
        bias = getattr(module, "bias", None)
        return Matrix(kind, 0, weight.shape[0], weight.shape[1], 0, self._tensor(weight), None, None,
                      self._float32(bias), _act(None))

    def _packed(self, weight, quantizer, bias: torch.Tensor | None = None, keep: bool = True) -> Matrix:
        """A packed matrix for C; keep=False: `weight` is kept alive by its holder (the cache's slot, `_held`), and
        its tensors must be contiguous already (no copy is made that would need keeping)."""
        if not gemv_takes(weight.shape, weight.bits, weight.scale.shape[-1], self.kernels.path):
            raise NotNative(f"a {weight.bits}-bit {weight.shape[0]}x{weight.shape[1]} matrix is not on the kernels' "
                            "grid")
        tensors = (weight.codes, weight.scale, weight.zero)
        if keep:
            pointers = [self._tensor(t) for t in tensors]
        else:
            assert all(t.is_contiguous() for t in tensors)
            pointers = [t.data_ptr() for t in tensors]
        return Matrix(MAT_PACKED, weight.bits, weight.shape[0], weight.shape[1],
                      weight.shape[1] // weight.scale.shape[-1], *pointers, self._float32(bias), _act(quantizer),
                      LAYOUTS.index(weight.layout))

    def _entry(self, weights: ExpertWeights, quantizers, keep: bool = True) -> Expert:
        """One expert's table entry: its two packed matrices with the experts' input and mid activation grids."""
        input_quant, mid_quant = quantizers
        return Expert(self._packed(weights.gate_up, input_quant, keep=keep),
                      self._packed(weights.down, mid_quant, keep=keep))

    def _experts(self, row: int, module) -> tuple[int, int]:
        """The layer's experts at their allocation: (table pointer, intermediate). With every expert in the fast
        tier, from the cache, pinned for good; else every served expert starts absent (`_load_absent`)."""
        runtime = self.runtime
        bits_row = runtime.artifact.allocation[row]
        table = (Expert * len(bits_row))()
        self._keep.append(table)
        if self.loads:
            self._tables[row] = (table, module.quantizers)
            for expert, bits in enumerate(bits_row):
                if bits:
                    table[expert] = _absent()
            return ctypes.addressof(table), runtime.artifact.expert_shape("gate_up")[0] // 2
        runtime.cache.pin(row, range(len(bits_row)))
        inter = 0
        for expert, bits in enumerate(bits_row):
            if not bits:
                continue
            weights = runtime.cache.get(row, expert, bits)
            if weights.transient or not weights.packed:
                raise NotNative("an expert is not resident in the packed cache")
            weights = runtime.cache.relayout(row, expert, runtime.compute.relaid)
            table[expert] = self._entry(weights, module.quantizers)
            inter = max(inter, weights.gate_up.shape[0] // 2)
        return ctypes.addressof(table), inter

    # --- a fast tier smaller than the experts

    def _ahead(self, row: int) -> tuple[int, int]:
        """(file descriptor, ranges pointer) of MoE row `row` for decode.c's read_ahead: each served expert's
        replica at its allocated width as at most AHEAD_RANGES byte ranges of its shard."""
        artifact = self.runtime.artifact
        ranges = torch.zeros(artifact.num_experts, AHEAD_RANGES, 2, dtype=torch.int64)
        for expert, bits in enumerate(artifact.allocation[row]):
            if bits:
                merged = byte_ranges(artifact.expert_spans(row, expert, bits), AHEAD_RANGES)
                ranges[expert, :len(merged)] = torch.tensor(merged, dtype=torch.int64)
        self._keep.append(ranges)
        return artifact.expert_fd(row), ranges.data_ptr()

    def _gone(self, key: tuple[int, int]) -> None:
        """The cache's watcher: (row, expert)'s weights are evicted or replaced, its table entry becomes absent."""
        entry = self._tables.get(key[0])
        if entry is not None and self._held.pop(key, None) is not None:
            entry[0][key[1]] = _absent()

    def _load_absent(self) -> None:
        """The step stopped at a layer whose kept experts are not all resident (Resume): make them resident - the
        layer's kept experts pinned meanwhile, so that loading one never evicts another - re-laid for the kernels, and
        in the layer's table. Loads go through the cache as the transformers path's misses do (counted, LRU
        eviction, the evicted entries made absent by `_gone`), without the admission cost model: a transient load
        would leave the table pointing at scratch the next load reuses (`unsupported` makes sure room can always be
        made for a layer's top-k)."""
        cache, resume = self.runtime.cache, self.resume
        row = self._rows[resume.layer]
        table = self._tables[row][0]
        bits_row = self.runtime.artifact.allocation[row]
        kept = list(resume.ids[:resume.n])
        absent = [e for e in kept if table[e].gate_up.kind == MAT_ABSENT]
        if not absent:
            raise ValueError(f"the native step stopped at layer {resume.layer} with every kept expert resident")
        with cache.pinned(row, kept):
            for expert in absent:
                weights = cache.get(row, expert, bits_row[expert], admit=False)
                if weights.transient or not weights.packed:
                    raise ValueError(f"expert {expert} of MoE layer {row} was not cached (a transient load)")
                self._publish(row, expert)

    def _publish(self, row: int, expert: int) -> None:
        """Point (row, expert)'s table entry at its resident weights, re-laid for the kernels (it must be pinned)."""
        table, quantizers = self._tables[row]
        weights = self.runtime.cache.relayout(row, expert, self.runtime.compute.relaid)
        self._held[(row, expert)] = weights
        table[expert] = self._entry(weights, quantizers, keep=False)

    def _adopt_resident(self) -> None:
        """Serve from the start what the cache already holds at the served width (the warm start's experts, the
        prompt's): a step stops only for experts that must be read."""
        cache, allocation = self.runtime.cache, self.runtime.artifact.allocation
        cache.wait_idle()  # nothing evicts behind the pins below
        for (row, expert), bits in cache.resident().items():
            if row in self._tables and (row, expert) not in self._held and bits == allocation[row][expert]:
                with cache.pinned(row, [expert]):
                    self._publish(row, expert)

    def _touch_logged(self) -> None:
        """Hand the experts the step served from its tables to the cache (hits and recency), then empty the log."""
        experts = self.model.num_experts
        keys = [(self._rows[code // experts], code % experts) for code in self._log[:self.resume.logged]]
        self.runtime.cache.touch(keys)
        self.resume.logged = 0

    def _describe(self) -> Model:
        runtime = self.runtime
        config = runtime.model.config
        adapter = adapter_for(config.model_type)
        base = runtime.model.model
        first = base.layers[0].self_attn
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = first.head_dim
        layers = (Layer * len(base.layers))()
        inter = mlp_inter = 0
        normalize = routing_normalized(config)
        for index, layer in enumerate(base.layers):
            attn = getattr(layer, adapter.attention)
            entry = layers[index]
            entry.input_norm = self._float32(getattr(layer, adapter.input_norm).weight)
            entry.post_norm = self._float32(getattr(layer, adapter.post_attention_norm).weight)
            for name in ("q", "k", "v", "o"):
                setattr(entry, name, self._matrix(getattr(attn, f"{name}_proj")))
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            if q_norm is not None:
                entry.qk_norm = QK_HEAD if q_norm.weight.numel() == head_dim else QK_WHOLE
                entry.q_norm, entry.k_norm = self._float32(q_norm.weight), self._float32(k_norm.weight)
            block = getattr(layer, adapter.moe)
            if index in self._rows:
                entry.moe = 1
                entry.router = self._matrix(getattr(block, adapter.router))
                entry.experts, width = self._experts(self._rows[index], getattr(block, adapter.experts))
                inter = max(inter, width)
                if self.loads:
                    entry.ahead_fd, entry.ahead = self._ahead(self._rows[index])
                mlp = getattr(block, adapter.shared_expert) if adapter.shared_expert else None
                gate = getattr(block, adapter.shared_expert_gate) if adapter.shared_expert_gate else None
                entry.shared_gate = self._matrix(gate)
            else:
                mlp = block
            if mlp is not None:
                entry.mlp_gate, entry.mlp_up = self._matrix(mlp.gate_proj), self._matrix(mlp.up_proj)
                entry.mlp_down = self._matrix(mlp.down_proj)
                mlp_inter = max(mlp_inter, entry.mlp_gate.rows)
        self._keep.append(layers)
        rotary = base.rotary_emb
        embed = base.embed_tokens.weight
        window = getattr(first, "sliding_window", None) or 0
        model = Model(len(base.layers), config.hidden_size, heads, kv_heads, head_dim, config.vocab_size,
                      runtime.artifact.num_experts, config.num_experts_per_tok, int(normalize), inter, mlp_inter,
                      int(window), float(base.norm.variance_epsilon), float(first.scaling),
                      float(getattr(rotary, "attention_scaling", 1.0)), float(getattr(config, "clip_qkv", None) or 0),
                      self._float32(rotary.inv_freq), MAT_BF16 if embed.dtype == torch.bfloat16 else MAT_F32,
                      self._tensor(embed), self._float32(base.norm.weight), self._matrix(runtime.model.lm_head),
                      ctypes.addressof(layers), None, None, 0)
        return model

    # --- serving

    def start(self, past, positions: int, capacity: int, first: int = 0) -> None:
        """A new sequence whose first `positions` tokens the transformers path prefilled into `past` (its KV cache):
        room for `capacity` positions, the prompt's keys and values from position `first` on copied in (rounded to the
        cache's dtype: copy_prompt); those before `first` are the previous prompt's, kept (hexq.runtime.prefix)."""
        m, self.prompt = self.model, []  # the caller names the new prompt once its keys and values are in
        if capacity > m.max_pos:
            shape, dtype = (m.layers, m.kv_heads, capacity, m.head_dim), KV_CACHES[self.runtime.config.kv_cache]
            old_k, old_v = (self.k_cache, self.v_cache) if first else (None, None)
            self.k_cache = grown_cache(old_k, shape, dtype, "cpu", first)
            self.v_cache = grown_cache(old_v, shape, dtype, "cpu", first)
            m.max_pos, m.kv_half = capacity, int(dtype == torch.float16)
            m.k_cache, m.v_cache = self.k_cache.data_ptr(), self.v_cache.data_ptr()
            self.scratch = torch.empty(self.library.hexq_decode_scratch(ctypes.byref(m)), dtype=torch.uint8)
        copy_prompt(self.k_cache, self.v_cache, past, first, positions)
        self.positions = positions
        if self.loads:
            self._adopt_resident()

    def step(self, token: int) -> torch.Tensor:
        """Logits [vocab] float32 of `token` at the next position (its keys and values join the cache)."""
        if self.positions >= self.model.max_pos:
            raise ValueError(f"the native KV cache holds {self.model.max_pos} positions")
        logits = torch.empty(self.model.vocab, dtype=torch.float32)
        if self.loads:  # no background load may evict what a table points at while the step reads it
            self.runtime.cache.wait_idle()
        self.resume.layer, self.resume.logged = -1, 0
        while True:
            code = self.library.hexq_decode(ctypes.byref(self.model), token, self.positions, logits.data_ptr(),
                                            self.kernels._path_index, self.kernels.threads, self.scratch.data_ptr(),
                                            ctypes.byref(self.resume))
            if self.loads:
                self._touch_logged()
            if code != 1:
                break
            self._load_absent()
        if code != 0:
            raise ValueError(f"the native decode step refused token {token} at position {self.positions}")
        self.positions += 1
        return logits

    def profile(self) -> dict[str, float]:
        """Seconds per step since the last call: in the pool's matrix products ("products"), in attention, and
        outside both ("glue": norms, RoPE, routing, the weighted sums on one thread), with the step count; under a
        fast tier smaller than the experts, per step the misses read ahead at their routing ("missed") and the
        absent experts the look-ahead read ahead for the next layer ("predicted"), and the share of those the next
        routing kept ("ahead_precision")."""
        out = (ctypes.c_double * 7)()
        self.library.hexq_decode_profile(out)
        products, attention, total, steps, missed, predicted, predicted_routed = out
        per = 1 / steps if steps else 0.0
        return {"products": products * per, "attention": attention * per,
                "glue": (total - products - attention) * per, "steps": int(steps), "missed": missed * per,
                "predicted": predicted * per, "ahead_precision": predicted_routed / predicted if predicted else 0.0}


def byte_ranges(spans, most: int) -> list[tuple[int, int]]:
    """`spans` (anything with start and end) as (offset, length) ranges, adjacent ones merged; beyond `most`
    ranges, the last one reaches to the end of the rest (reading a little more rather than nothing)."""
    merged: list[list[int]] = []
    for span in sorted(spans, key=lambda span: span.start):
        if merged and span.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.end)
        else:
            merged.append([span.start, span.end])
    if len(merged) > most:
        merged[most - 1:] = [[merged[most - 1][0], merged[-1][1]]]
    return [(start, end - start) for start, end in merged]


def _absent() -> Expert:
    return Expert(Matrix(MAT_ABSENT), Matrix(MAT_ABSENT))


def unsupported(runtime) -> None:
    """Raise NotNative naming the first reason `runtime` is served by the transformers path instead (see the module
    docstring); return when the native step covers it."""
    config = runtime.config
    model_config = runtime.model.config
    unsupported_model(runtime)
    if runtime.compute.kernels is None:
        raise NotNative("no CPU kernels (" + ("--kernels torch" if config.kernels == "torch" else
                                              "triton" if runtime.compute.triton else "the build failed") + ")")
    if config.policy != "static":
        raise NotNative(f"the {config.policy} policy chooses widths per token in Python")
    if config.mode != "cache" or config.cache != "packed":
        raise NotNative(f"--cache {config.cache} / mode {config.mode}: the step reads packed resident experts")
    if not runtime.plan.holds_every_expert and runtime.plan.fast_tier_bytes < top_k_bytes(runtime):
        raise NotNative(f"the fast tier holds fewer than {model_config.num_experts_per_tok} of the largest experts "
                        "(a layer's top-k must fit while the step loads its misses)")
    if model_config.num_experts_per_tok > MAX_TOP_K or runtime.artifact.num_experts > MAX_EXPERTS:
        raise NotNative(f"top-{model_config.num_experts_per_tok} of {runtime.artifact.num_experts} experts")
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    if heads // kv_heads > MAX_GROUP:
        raise NotNative(f"{heads} query heads on {kv_heads} KV heads")
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    if head_dim > MAX_HEAD_DIM:
        raise NotNative(f"head_dim {head_dim}")
    # a matrix of another dtype or off the kernels' grid is named while the model is described (NativeDecoder._matrix)


def top_k_bytes(runtime) -> int:
    """Bytes of a layer's top-k experts at the largest slot: what the fast tier must hold for the native step to load
    one layer's misses while the layer's other kept experts stay pinned."""
    return runtime.model.config.num_experts_per_tok * runtime.source.sizes.largest_slot
