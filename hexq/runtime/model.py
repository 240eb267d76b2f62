"""A model computing as the artifact says, built on the meta device so that nothing is allocated that the artifact
does not ask for.

Two ways to run it:
- `build_model` (`hexq run`): the dense part (attention, norms, routers, shared experts, dense layers, embeddings,
  head) materialized for good from the artifact's dense shards in the serving dtype, quantized linears kept as their
  packed codes (hexq.runtime.compute.PackedLinear, with their activation quantization); each MoE layer's routed
  experts replaced, in one place, by a module the caller chooses (the budgeted cache). The experts exist nowhere
  else.
- `artifact_model` (`hexq eval ARTIFACT`): streamed like any other target (hexq.model.layer_pass.stream_nll), one
  layer's dense part and its experts at the artifact's allocation at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hexq.artifact.format import HEAD_WEIGHT, expert_shard
from hexq.artifact.reader import Artifact
from hexq.model.layer_pass import ExpertCompute, expert_chunk
from hexq.model.simulate import ActQuantizer, act_quantizer, attach_input_quant
from hexq.model.streaming import LoadedLayer, StreamedModel, _tensor_slots
from hexq.packed.weight import CODE_PAD, PackedWeight
from hexq.runtime.compute import PackedLinear

ExpertsFactory = Callable[[int, torch.nn.Module], torch.nn.Module]  # (MoE row, the family's module) -> replacement
# (MoE row, expert ids) -> (gate_up [n, 2I, H], down [n, H, I])
ExpertWeights = Callable[[int, list[int]], tuple[torch.Tensor, torch.Tensor]]


def artifact_config(artifact: Artifact):
    """The model config stored in the artifact (checked against the manifest first)."""
    from transformers import AutoConfig

    for name in ("config.json", "tokenizer.json"):
        if name in artifact.files:
            artifact.verify(name)
    return AutoConfig.from_pretrained(artifact.path, local_files_only=True)


def artifact_tokenizer(artifact: Artifact):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(artifact.path, local_files_only=True)


def expert_quantizers(artifact: Artifact, row: int) -> tuple[ActQuantizer | None, ActQuantizer | None]:
    """(input, intermediate) activation quantizers of MoE layer row `row`'s routed experts, from the recipe."""
    setting = artifact.recipe.expert_activations
    if setting.bits is None:
        return None, None
    shard = expert_shard(artifact.moe_layers[row])
    keys = artifact.keys(shard)
    ranges = [artifact.tensor(shard, key) if key in keys else None for key in ("act.input", "act.mid")]
    return act_quantizer(setting, ranges[0]), act_quantizer(setting, ranges[1])


def attach_dense_quantizers(model: torch.nn.Module, artifact: Artifact, names: list[str]) -> list:
    """Activation quantization on the quantized linears among `names` (weight names); returns the hook handles."""
    setting = artifact.recipe.activations
    handles = []
    for weight_name in names:
        linear = weight_name.removesuffix(".weight")
        quantizer = act_quantizer(setting, artifact.act_range(linear))
        if quantizer is not None:
            handles.append(attach_input_quant(model.get_submodule(linear), quantizer))
    return handles


def artifact_model(path, device: torch.device, dtype: torch.dtype = torch.float32,
                   allocation: list[list[int]] | None = None, expert_weights: ExpertWeights | None = None):
    """(streamed model, tokenizer, prepare) of an artifact at its static allocation (or at `allocation`, [MoE row]
    [expert] widths the artifact stores, e.g. to compare allocations of one `--bank all` artifact; or with the
    routed experts' weights from `expert_weights(row, experts)`, e.g. the replicas an export wrote), for
    hexq.model.layer_pass.stream_nll. An expert at 0 bits is skipped, its routing weight renormalised onto the token's
    kept experts (hexq.model.simulate.routed_outputs), as `hexq run` serves it."""
    artifact = path if isinstance(path, Artifact) else Artifact(path)
    streamed = StreamedModel(artifact_config(artifact), artifact, device, dtype)
    rows = {layer: row for row, layer in enumerate(artifact.moe_layers)}
    quantized = list(artifact.quantized_linears)

    def prepare(loaded: LoadedLayer) -> ExpertCompute | None:
        prefix = f"model.layers.{loaded.index}."
        loaded.hooks += attach_dense_quantizers(streamed.model, artifact,
                                                [name for name in quantized if name.startswith(prefix)])
        if not loaded.is_moe:
            return None
        row = rows[loaded.index]
        bits = (allocation or artifact.allocation)[row]

        def weights_of(experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            if expert_weights is not None:
                return tuple(t.to(device=device, dtype=dtype) for t in expert_weights(row, experts))
            pairs = [artifact.expert_weights(row, e, bits[e], dtype) for e in experts]
            return (torch.stack([p[0] for p in pairs]).to(device), torch.stack([p[1] for p in pairs]).to(device))

        _num, gate_up_shape, down_shape = loaded.shapes
        return ExpertCompute(weights_of, *expert_quantizers(artifact, row),
                             chunk=expert_chunk(gate_up_shape, down_shape, dtype),
                             kept=torch.tensor([b > 0 for b in bits], device="cpu"))

    return streamed, artifact_tokenizer(artifact), prepare


def skeleton(artifact: Artifact, device: torch.device, dtype: torch.dtype) -> StreamedModel:
    """The model of an artifact on the meta device (nothing allocated yet), to be materialized in `dtype`."""
    return StreamedModel(artifact_config(artifact), artifact, device, dtype)


def dense_plan_bytes(streamed: StreamedModel, artifact: Artifact) -> int:
    """Bytes of the dense part once `build_model` has run: every parameter and persistent buffer outside the routed
    experts in the compute dtype (integer tensors in their own), quantized linears as their stored packed bytes,
    tied embeddings once, plus the buffers the skeleton holds already (rotary frequencies). Read from the meta
    skeleton and the shards' headers, so a memory budget can be checked before anything is allocated."""
    skip = streamed.experts_path
    quantized = artifact.quantized_linears
    tied = bool(getattr(streamed.config, "tie_word_embeddings", False))
    total = sum(buffer.numel() * buffer.element_size() for module in streamed.model.modules()
                for name, buffer in module._buffers.items()
                if buffer is not None and name in module._non_persistent_buffers_set)
    for name, _owner, _attr, _is_parameter in _tensor_slots(streamed.model):
        if tied and name == "lm_head.weight":
            continue
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and streamed.is_moe(int(parts[2])) \
                and ".".join(parts[3:]).startswith(skip + "."):
            continue
        if name in quantized:
            total += artifact.packed_param_nbytes(name)
            continue
        tensor = streamed.model.get_parameter(name) if _is_parameter else streamed.model.get_buffer(name)
        size = streamed.dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * size
    return total


def build_model(artifact: Artifact, experts: ExpertsFactory, device: torch.device, dtype: torch.dtype,
                streamed: StreamedModel, compute):
    """(model, tokenizer) in eval mode: the dense part materialized in `dtype` on `device` except the quantized
    linears, which become PackedLinears on their stored codes (hexq.runtime.compute, with the recipe's activation
    quantization); each MoE layer's routed experts replaced by experts(row, family_module) (see the module
    docstring). `streamed` is the skeleton (made first, to size a memory budget with dense_plan_bytes)."""
    quantized = artifact.quantized_linears
    streamed.materialize_dense(leave=frozenset(quantized))
    setting = artifact.recipe.activations
    for weight_name in quantized:
        path = weight_name.removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        linear = streamed.model.get_submodule(path)
        packed = artifact.read_packed_copy(weight_name, tuple(linear.weight.shape))
        codes = packed.codes
        if compute.triton:  # the pair GEMV's second byte load reads one byte past a code: pad the buffer
            codes = torch.cat([codes, torch.zeros(CODE_PAD, dtype=codes.dtype, device=codes.device)])
        packed = PackedWeight(codes.to(device), packed.scale.to(device), packed.zero.to(device), packed.bits,
                              packed.shape)
        bias = linear.bias.detach() if getattr(linear, "bias", None) is not None else None
        # the head is weight-only (hexq.calib.head): its input, the final norm's output, stays in full precision
        quantizer = None if weight_name == HEAD_WEIGHT else act_quantizer(setting, artifact.act_range(path))
        setattr(streamed.model.get_submodule(parent), child, PackedLinear(packed, bias, quantizer, compute))
        artifact.release()
    adapter = streamed.adapter
    for row, index in enumerate(artifact.moe_layers):
        moe = getattr(streamed.layers[index], adapter.moe)
        setattr(moe, adapter.experts, experts(row, getattr(moe, adapter.experts)))
    return streamed.model.eval(), artifact_tokenizer(artifact)


def dense_bytes(model: torch.nn.Module) -> int:
    """Bytes of every materialized parameter and buffer (the meta-device experts count nothing)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta" or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total
