"""Running a model bigger than memory: one decoder layer at a time, every window through layer l before l+1.

`StreamedModel` builds the model skeleton with its parameters on the meta device (no memory; buffers such as the
rotary frequencies stay real) and materializes one decoder layer at a time from a `LayerSource` (a Hugging Face
checkpoint, a calibration, an artifact): its dense part (attention, norms, router, shared expert, or a dense MLP)
upcast to the compute dtype on the compute device, its routed experts left in their stored form for the caller
to compute expert by expert (hexq.model.simulate.ExpertTap). Leaving the `layer()` block puts the layer back on the
meta device, so peak memory is one layer plus the activations, whatever the depth of the model.

Activations live in a `HiddenStore`: in memory up to a byte limit, spilled to files beyond it.

The embedding and the head are materialized only for the step that needs them (`layer_inputs`, `head_nll`).
This is the sequential onloading schedule of llm-compressor and GPTQ's layer-by-layer calibration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from hexq.base.errors import HexqError
from hexq.base.hidden import HiddenStore
from hexq.model.adapters import MoEAdapter, adapter_for, check_moe_layers
from hexq.model.attention import ATTENTION
from hexq.model.checkpoint import Checkpoint
from hexq.model.folder import check_moe_folder
from hexq.model.simulate import ExpertTap

Progress = Callable[[str, int, int], None]


class LayerSource(Protocol):
    """Where a streamed model's weights come from."""

    def read_param(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A parameter or persistent buffer by its full model name, in its stored dtype."""
        ...

    def release(self) -> None:
        """Drop what reading kept mapped (called after each materialization)."""
        ...

    def param_dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype of a parameter, without reading it."""
        ...


# ------------------------------------------------------------------------------------------ layer 0's inputs


@dataclass
class LayerBatch:
    """One batch of windows at the input of a decoder layer."""

    hidden: torch.Tensor  # [B, L, H]
    kwargs: dict  # attention mask, position ids and embeddings, as the model passes them to every layer


class Recorder(torch.nn.Module):
    """Stands in for the decoder stack: records a layer's inputs and returns the hidden states unchanged, so the
    model's own embedding, mask and rotary code produce layer 0's inputs (no family-specific copy of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[LayerBatch] = []

    def forward(self, hidden_states, **kwargs):
        kept = {k: v for k, v in kwargs.items() if k not in {"past_key_values", "use_cache"}}
        self.seen.append(LayerBatch(hidden_states, kept))
        return hidden_states


# ------------------------------------------------------------------------------------------ the skeleton


@dataclass
class LoadedLayer:
    """A decoder layer materialized for computing. On a MoE layer the experts inside `module` are an ExpertTap
    (`tap`), and the source's routed experts are read in their stored dtype ([E, 2I, H] / [E, H, I]) on first use
    of `gate_up`/`down`, or only the experts `read_experts` names (one rank's share: the other experts' bytes are
    never read); `experts_of` indexes them by expert id whichever were read. Without a reader (a layer materialized
    without its experts, served otherwise) they are None."""

    index: int
    module: torch.nn.Module
    reader: Callable[[range], tuple[torch.Tensor, torch.Tensor]] | None
    act_fn: Callable | None
    tap: torch.nn.Module | None  # the hexq.model.simulate.ExpertTap standing in for the experts
    shapes: tuple[int, tuple[int, int], tuple[int, int]] | None = None  # (experts, gate_up [2I, H], down [H, I])
    hooks: list = field(default_factory=list)  # handles of hooks attached while materialized (removed at exit)
    read: range | None = None  # the experts read so far (None: none yet)
    _experts: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_moe(self) -> bool:
        return self.tap is not None

    def read_experts(self, experts: range) -> None:
        """Read the routed experts `experts` (consecutive ids) from the source, replacing any read before."""
        self._experts, self.read = self.reader(experts), experts

    def share(self, experts: range) -> torch.Tensor:
        """gate_up [len(experts), 2I, H] of the consecutive experts `experts` (one rank's share; every expert in one
        process), read unless they are what was read already."""
        if self.read != experts:
            self.read_experts(experts)
        return self._experts[0]

    def _stored(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._experts is None and self.reader is not None:
            self.read_experts(range(self.shapes[0]))
        return self._experts

    @property
    def gate_up(self) -> torch.Tensor | None:
        """Every routed expert's gate_up [E, 2I, H] (read on first use), or None without a reader."""
        stored = self._stored()
        if stored is not None and self.read != range(self.shapes[0]):
            raise HexqError(f"layer {self.index}: only experts {self.read.start}..{self.read.stop - 1} were read")
        return None if stored is None else stored[0]

    @property
    def down(self) -> torch.Tensor | None:
        """Every routed expert's down [E, H, I], as gate_up."""
        return None if self.gate_up is None else self._experts[1]

    def experts_of(self, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of `experts` (ids) in their stored dtype, from the experts read (all, on first use)."""
        gate_up, down = self._stored()
        first, stop = self.read.start, self.read.stop
        outside = [e for e in experts if not first <= e < stop]
        if outside:
            raise HexqError(f"layer {self.index}: expert {outside[0]} was not read (this process read experts "
                            f"{first}..{stop - 1})")
        rows = [e - first for e in experts]
        return gate_up[rows], down[rows]


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    found = []
    for prefix, sub in module.named_modules():
        for name in sub._buffers:
            if name not in sub._non_persistent_buffers_set and sub._buffers[name] is not None:
                found.append((f"{prefix}.{name}" if prefix else name, sub, name))
    return found


def _tensor_slots(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, bool]]:
    """(name relative to module, owner, attribute, is_parameter) of every parameter and persistent buffer."""
    slots = []
    for prefix, sub in module.named_modules():
        for name, param in sub._parameters.items():
            if param is not None:
                slots.append((f"{prefix}.{name}" if prefix else name, sub, name, True))
    slots += [(name, sub, attr, False) for name, sub, attr in _persistent_buffers(module)]
    return slots


def _put(owner: torch.nn.Module, attr: str, value: torch.Tensor, is_parameter: bool) -> None:
    if is_parameter:
        owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


def _to_meta(module: torch.nn.Module) -> None:
    """Put every parameter and persistent buffer back on the meta device (frees them); non-persistent buffers (e.g.
    rotary frequencies computed at construction) are kept, since no source can give them back."""
    for _name, owner, attr, is_parameter in _tensor_slots(module):
        current = owner._parameters[attr] if is_parameter else owner._buffers[attr]
        _put(owner, attr, torch.empty_like(current, device="meta"), is_parameter)


class StreamedModel:
    """The skeleton of a causal MoE model with parameters on the meta device; see the module docstring."""

    def __init__(self, config, source: LayerSource, device: torch.device,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config, self.source, self.device, self.dtype = config, source, device, compute_dtype
        self.adapter: MoEAdapter = adapter_for(config.model_type)
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary) real
            model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
        for module in model.modules():  # non-persistent buffers (rotary inv_freq) to the compute device
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device.type != "meta":
                    module._buffers[name] = buffer.to(device)
        self.model = model.eval()
        # per layer: (num_experts, gate_up [2I, H], down [H, I]) from the skeleton, or None for a dense layer
        self.moe_shapes: list[tuple[int, tuple[int, int], tuple[int, int]] | None] = []
        for layer in self.layers:
            experts = getattr(getattr(layer, self.adapter.moe, None), self.adapter.experts, None)
            self.moe_shapes.append(None if experts is None else (
                experts.gate_up_proj.shape[0], tuple(experts.gate_up_proj.shape[1:]),
                tuple(experts.down_proj.shape[1:])))

    # ------------------------------------------------------------------------------------------ structure

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def experts_module(self, index: int) -> torch.nn.Module | None:
        """The routed-experts module of layer `index` (outside a `layer()` block), or None for a dense layer (e.g.
        DeepSeek's first layers)."""
        moe = getattr(self.layers[index], self.adapter.moe, None)
        return getattr(moe, self.adapter.experts, None) if moe is not None else None

    def is_moe(self, index: int) -> bool:
        return self.moe_shapes[index] is not None

    def expert_shapes(self, index: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
        """(num_experts, gate_up [2I, H], down [H, I]) of a MoE layer."""
        return self.moe_shapes[index]

    # ------------------------------------------------------------------------------------------ materializing

    def _materialize(self, module: torch.nn.Module, prefix: str, skip: str | None = None, copy: bool = False,
                     leave: frozenset[str] = frozenset()) -> None:
        for name, owner, attr, is_parameter in _tensor_slots(module):
            if skip is not None and (name == skip or name.startswith(skip + ".")) or prefix + name in leave:
                continue
            current = owner._parameters[attr] if is_parameter else owner._buffers[attr]
            stored, owned = self._read(prefix + name, tuple(current.shape), copy)
            dtype = self.dtype if stored.is_floating_point() else stored.dtype
            _put(owner, attr, stored.to(device=self.device, dtype=dtype, copy=copy and not owned), is_parameter)

    @contextmanager
    def layer(self, index: int, experts: bool = True) -> Iterator[LoadedLayer]:
        """Layer `index` materialized (dense part in the compute dtype on the device; routed experts, when
        `experts`, read in their stored dtype on the CPU when first used, behind an ExpertTap), put back on meta when
        the block ends."""
        layer = self.layers[index]
        prefix = f"model.layers.{index}."
        original = self.experts_module(index)
        reader = act_fn = tap = loaded = None
        try:
            if original is None:
                self._materialize(layer, prefix)
            else:
                num, gate_up_shape, down_shape = self.expert_shapes(index)
                self._materialize(layer, prefix, skip=self.experts_path)
                if experts:
                    def reader(rows: range) -> tuple[torch.Tensor, torch.Tensor]:
                        try:
                            return self.source.read_fused_experts(prefix + self.experts_path, num, gate_up_shape,
                                                                  down_shape, rows)
                        finally:
                            self.source.release()
                act_fn = original.act_fn
                tap = ExpertTap(num)
                setattr(getattr(layer, self.adapter.moe), self.adapter.experts, tap)
            self.source.release()
            loaded = LoadedLayer(index, layer, reader, act_fn, tap, self.moe_shapes[index])
            yield loaded
        finally:
            for handle in loaded.hooks if loaded is not None else []:
                handle.remove()
            if original is not None:
                setattr(getattr(layer, self.adapter.moe), self.adapter.experts, original)
            _to_meta(layer)

    @property
    def experts_path(self) -> str:
        """The routed experts' module path relative to a decoder layer (e.g. mlp.experts)."""
        return f"{self.adapter.moe}.{self.adapter.experts}"

    def materialize_dense(self, leave: frozenset[str] = frozenset()) -> None:
        """Materialize, for good, every parameter except the routed experts and the names in `leave` (which stay on
        meta: the caller replaces their modules): the dense part a server keeps resident (`hexq run`)."""
        # Copies, never views of the source's file mapping: a mapped tensor would be read from disk at its first use
        # (the first request pays for it) and whenever the page cache drops it; the maps are released per layer.
        for index, layer in enumerate(self.layers):
            self._materialize(layer, f"model.layers.{index}.", skip=self.experts_path if self.is_moe(index) else None,
                              copy=True, leave=leave)
            self.source.release()
        tied = getattr(self.config, "tie_word_embeddings", False)
        for name in ("model.embed_tokens", "model.norm", "lm_head"):
            if name == "lm_head" and tied:  # one copy, as the source had: never a second one, even for a moment
                self.model.lm_head.weight = self.model.model.embed_tokens.weight
                continue
            self._materialize_top(self.model.get_submodule(name), name, copy=True, leave=leave)
            self.source.release()

    @contextmanager
    def parts(self, *names: str, dtype: torch.dtype | None = None) -> Iterator[None]:
        """Materialize top-level modules (e.g. "model.embed_tokens", "model.norm", "lm_head") for the block, in
        `dtype` (default: the compute dtype)."""
        modules = [self.model.get_submodule(name) for name in names]
        try:
            for name, module in zip(names, modules, strict=True):
                self._materialize_top(module, name, dtype)
            self.source.release()
            yield
        finally:
            for module in modules:
                _to_meta(module)

    def _materialize_top(self, module: torch.nn.Module, name: str, dtype: torch.dtype | None = None,
                         copy: bool = False, leave: frozenset[str] = frozenset()) -> None:
        tied = name == "lm_head" and getattr(self.config, "tie_word_embeddings", False)
        for rel, owner, attr, is_parameter in _tensor_slots(module):
            current = owner._parameters[attr] if is_parameter else owner._buffers[attr]
            key = f"{name}.{rel}"
            if key in leave:  # e.g. a quantized head's weight: never read whole, not even for a moment
                continue
            if tied and not self.source_has(key):
                key = "model.embed_tokens.weight"
            stored, owned = self._read(key, tuple(current.shape), copy)
            _put(owner, attr, stored.to(device=self.device, dtype=dtype or self.dtype, copy=copy and not owned),
                 is_parameter)

    def _read(self, name: str, shape: tuple[int, ...], copy: bool) -> tuple[torch.Tensor, bool]:
        """(tensor, whether it is in memory of its own): with `copy`, through the source's read_param_copy when it
        has one (no mapping at all, so no moment with both the file pages and the copy), else read_param."""
        reader = getattr(self.source, "read_param_copy", None) if copy else None
        if reader is not None:
            return reader(name, shape), True
        return self.source.read_param(name, shape), False

    def source_has(self, key: str) -> bool:
        has = getattr(self.source, "has_param", None)
        return bool(has(key)) if has is not None else True

    # ------------------------------------------------------------------------------------------ the two ends

    @torch.no_grad()
    def layer_inputs(self, ids: torch.Tensor, batch_size: int, store: HiddenStore) -> list[dict]:
        """Hidden states entering layer 0 for every batch of windows ids [N, L] (appended to `store`), and each
        batch's layer kwargs (attention mask, position ids and embeddings), computed by the model's own code."""
        base = self.model.model
        layers, norm, recorder = base.layers, base.norm, Recorder()
        # The embedding stays in its stored dtype (a 150k-token vocabulary is 1.2 GB in float32); looking up rows and
        # upcasting them gives exactly the rows of the upcast table, and the model sees compute-dtype embeddings.
        with self.parts("model.embed_tokens", dtype=self.source_dtype("model.embed_tokens.weight")):
            base.layers, base.norm = torch.nn.ModuleList([recorder]), torch.nn.Identity()
            try:
                for batch in ids.split(batch_size):
                    embeds = base.embed_tokens(batch.to(self.device)).to(self.dtype)
                    base(inputs_embeds=embeds, use_cache=False)
            finally:
                base.layers, base.norm = layers, norm
        kwargs = []
        for seen in recorder.seen:
            store.append(seen.hidden)
            kwargs.append(seen.kwargs)
        return kwargs

    def source_dtype(self, name: str) -> torch.dtype:
        """The dtype a top-level parameter is stored in (floating), for materializing it without upcasting."""
        stored = self.source.param_dtype(name)
        return stored if stored is not None and stored.is_floating_point else self.dtype

    def head_dtype(self) -> torch.dtype:
        """The dtype the LM head is stored in (the embeddings' when tied to them): `parts("lm_head", dtype=...)`."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        return self.source_dtype("model.embed_tokens.weight" if tied else "lm_head.weight")

    @torch.no_grad()
    def head_nll(self, hidden: HiddenStore, ids: torch.Tensor, batch_size: int, positions: int = 1024,
                 vocab_rows: int = 32768) -> torch.Tensor:
        """Summed next-token NLL of each window [N] (float64) from the last layer's outputs.

        The head stays in its stored dtype and is upcast `vocab_rows` rows at a time: log-softmax over the
        vocabulary is an online logsumexp over those blocks (running max and scaled sum), so neither a float32
        copy of a large head nor [positions, vocab] logits exist at once."""
        out = []
        with self.parts("model.norm"), self.parts("lm_head", dtype=self.head_dtype()):
            norm, weight = self.model.model.norm, self.model.lm_head.weight
            bias = getattr(self.model.lm_head, "bias", None)
            for index, batch in enumerate(ids.split(batch_size)):
                states = norm(hidden[index].to(self.device))
                flat = states[:, :-1].reshape(-1, states.shape[-1]).to(self.dtype)
                targets = batch[:, 1:].reshape(-1).to(self.device)
                nll = torch.empty(targets.shape[0], dtype=torch.float32, device=self.device)
                for start in range(0, targets.shape[0], positions):
                    x, target = flat[start:start + positions], targets[start:start + positions]
                    nll[start:start + positions] = blocked_nll(x, weight, bias, target, vocab_rows, self.dtype)
                out.append(nll.reshape(batch.shape[0], -1).sum(dim=1).double().cpu())
        return torch.cat(out)


def blocked_nll(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                vocab_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Cross-entropy of logits x W^T (+ b) at `target`, the vocabulary in blocks of `vocab_rows` upcast to `dtype`:
    NLL = logsumexp(logits) - logits[target], the logsumexp accumulated block by block."""
    running_max = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
    running_sum = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    picked = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], vocab_rows):
        block = weight[start:start + vocab_rows].to(dtype)
        logits = F.linear(x, block, None if bias is None else bias[start:start + vocab_rows].to(dtype)).float()
        block_max = logits.amax(dim=1)
        new_max = torch.maximum(running_max, block_max)
        running_sum = running_sum * torch.exp(running_max - new_max) + torch.exp(logits - new_max[:, None]).sum(1)
        running_max = new_max
        inside = (target >= start) & (target < start + block.shape[0])
        rows = inside.nonzero().squeeze(1)
        picked[rows] = logits[rows, target[rows] - start]
    return torch.log(running_sum) + running_max - picked


def open_model(model_path: Path, device: torch.device) -> tuple[StreamedModel, object]:
    """(streamed model, tokenizer) of a local Hugging Face checkpoint folder."""
    from transformers import AutoConfig, AutoTokenizer  # importing transformers costs seconds: only when a model opens

    check_moe_folder(model_path)
    checkpoint = Checkpoint(model_path)
    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HexqError(f"cannot load model from {model_path}: {str(exc).splitlines()[0]}") from None
    streamed = StreamedModel(config, checkpoint, device)
    check_moe_layers(streamed.adapter, config, [i for i in range(streamed.num_layers) if streamed.is_moe(i)])
    return streamed, tokenizer
