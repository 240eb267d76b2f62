"""Export a hexq-quantized MoE model as a compressed-tensors checkpoint (the format vLLM serves), and load one
back with a check that every weight really came from the file.

Format (compressed-tensors 0.19, as llm-compressor writes it):
- config.json carries `quantization_config` {quant_method "compressed-tensors", format, config_groups, ignore}.
  Each config group is a QuantizationScheme: `targets` (exact module names or "re:" regexes, matched with
  re.match against checkpoint module names), `weights`/`input_activations` QuantizationArgs and its own `format`.
- "w4a16": 4-bit symmetric groups, format "pack-quantized": `<module>.weight_packed` int32 (8 codes per word,
  signed code + 8 stored unsigned), `<module>.weight_scale` [out, in/group], `<module>.weight_shape`
  int64 [out, in]; no zero point for symmetric schemes.
- "w8a8": int8 symmetric per-channel weights, format "int-quantized": `<module>.weight` int8 and
  `<module>.weight_scale` [out, 1]; the activations are quantized per token at run time (no tensor stored).
- Dequantization is x_q * scale with x_q signed. hexq's symmetric grid is the same grid: compressed-tensors'
  calculate_qparams uses scale = max|w| / ((qmax - qmin) / 2), i.e. max|w|/7.5 for 4 bits and max|w|/127.5 for
  8 bits, exactly hexq's 2*max|w|/(2^bits - 1), and hexq's codes minus the midpoint 2^(bits-1) are the signed
  x_q. Scales (and unquantized tensors) are stored in float32, so a loader reproduces hexq's dequantized
  weights bit for bit; a server casts them to its own dtype when it loads them.

Key names: transformers 5 keeps experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H]) but vLLM and
transformers' own loader expect the family's original per-expert keys (Mixtral
`block_sparse_moe.experts.N.w1/w2/w3`, Qwen-MoE `mlp.experts.N.gate_proj/up_proj/down_proj`). The export runs
codes and scales through transformers' `revert_weight_conversion`, the function save_pretrained uses, so the
names are whatever transformers' conversion mapping expects back.

Loading: transformers' CompressedTensorsHfQuantizer (`from_pretrained` with `CompressedTensorsConfig(
dequantize=True)`, the successor of run_compressed=False) dequantizes fused experts with ONE scheme for all
layers (`integrations/compressed_tensors.py: get_experts_scheme` takes the first group whose "re:" targets
mention "experts") and `DecompressExperts` only reads `weight_packed`: a checkpoint with w8a8 (int-quantized)
experts in any layer fails with a conversion error. All-w4a16 experts do load through it with exact weights,
but the model keeps compressed-tensors' forward wrappers, which fake-quantize the w8a8 attention inputs per
token. `load_exported` instead dequantizes the tensors model-free with compressed-tensors' own
`CompressedTensorsDequantizer` (per config group, the registered compressor's `decompress`), loads the dense
result through plain `from_pretrained` (which fuses the per-expert keys), and checks the model against the file.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from hexq.adapters import MoEAdapter
from hexq.algos.quant import QuantSpec, dequantize, quantize
from hexq.errors import HexqError

SCHEMES = ("w4a16", "w8a8")
W4_GROUP_SIZE = 128
# Never quantized even though they are nn.Linear: Qwen2-MoE's 1-wide shared-expert gate is a router.
NEVER_QUANTIZED = ("shared_expert_gate",)
WEIGHTS_FILE = "model.safetensors"
W8 = QuantSpec(bits=8, group_size=None)  # int8 per output channel


def _w4_spec(widths: list[int], group_size: int) -> QuantSpec:
    """One 4-bit grid for tensors that must share a scheme: `group_size` columns, or the narrowest input width
    when smaller, and it must divide every width."""
    group = min(group_size, *widths)
    bad = sorted({width for width in widths if width % group})
    if bad:
        raise HexqError(f"w4a16 needs input widths {bad} to be multiples of the group size {group}; "
                        f"pass a group_size that divides them")
    return QuantSpec(bits=4, group_size=group)


def _plan(model, adapter: MoEAdapter, layer_schemes: list[str], group_size: int) -> dict[str, QuantSpec]:
    """In-memory parameter name -> QuantSpec for every weight the export quantizes."""
    layers = model.model.layers
    if len(layer_schemes) != len(layers):
        raise HexqError(f"layer_schemes has {len(layer_schemes)} entries, the model has {len(layers)} layers")
    plan: dict[str, QuantSpec] = {}
    for index, (layer, scheme) in enumerate(zip(layers, layer_schemes, strict=True)):
        if scheme not in SCHEMES:
            raise HexqError(f"layer {index}: unknown scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
        prefix = f"model.layers.{index}"
        for name, module in layer.get_submodule(adapter.attention).named_modules():
            if isinstance(module, nn.Linear):
                plan[f"{prefix}.{adapter.attention}.{name}.weight"] = W8

        # Units of tensors that share one spec: each Linear of the MoE block (shared expert, or the MLP of a
        # dense layer) alone, and all fused routed experts together, because vLLM's fused MoE kernel needs
        # gate, up and down projections of every expert of a layer in the same scheme, group size included.
        block = layer.get_submodule(adapter.moe)
        units = [{f"{prefix}.{adapter.moe}.{name}.weight": module.weight}
                 for name, module in block.named_modules()
                 if isinstance(module, nn.Linear) and name.split(".")[0] not in (adapter.router, *NEVER_QUANTIZED)]
        if hasattr(block, adapter.experts):
            experts = block.get_submodule(adapter.experts).named_parameters(recurse=False)
            units.append({f"{prefix}.{adapter.moe}.{adapter.experts}.{name}": p for name, p in experts if p.ndim == 3})
        for unit in filter(None, units):
            spec = W8 if scheme == "w8a8" else _w4_spec([w.shape[-1] for w in unit.values()], group_size)
            plan |= dict.fromkeys(unit, spec)
    return plan


def _quantize_param(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(signed int8 codes, float32 scales, float32 dequantized weight) of a [out, in] or [E, out, in] tensor."""
    mats = w.detach().float().reshape(-1, *w.shape[-2:])
    codes, scales, deq = [], [], []
    for mat in mats:
        q, meta = quantize(mat, spec)
        codes.append((q.to(torch.int16) - 2 ** (spec.bits - 1)).to(torch.int8))  # hexq's midpoint -> signed
        scales.append(meta.scale)
        deq.append(dequantize(q, meta))
    return (torch.stack(codes).reshape(w.shape), torch.stack(scales).reshape(*w.shape[:-1], -1),
            torch.stack(deq).reshape(w.shape))


def _to_disk(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory names -> the family's checkpoint names (per-expert keys), as save_pretrained writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    return {key: value.contiguous() for key, value in revert_weight_conversion(model, state).items()}


def _targets(modules: list[str]) -> list[str]:
    """Config-group targets: one regex per experts container (every expert of a layer shares the scheme; the
    regex stops at the expert index so it also matches vLLM's own `experts.0.gate_proj` probes for families
    whose files say w1/w2/w3), exact names for everything else."""
    targets = []
    for name in modules:
        match = re.match(r"(.*\.experts\.)\d+\.", name)
        targets.append("re:" + re.escape(match.group(1)) + r"\d+\." if match else name)
    return list(dict.fromkeys(targets))


def _group_name(spec: QuantSpec) -> str:
    return "w8a8" if spec.bits == 8 else f"w4a16_g{spec.group_size}"


def _quantization_config(groups: dict[QuantSpec, list[str]]) -> dict:
    """config.json's quantization_config: one config group per (scheme, group size)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    def scheme(spec: QuantSpec, targets: list[str]) -> QuantizationScheme:
        if spec.bits == 4:
            weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                       group_size=spec.group_size)
            return QuantizationScheme(targets=targets, weights=weights, format="pack-quantized")
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(targets=targets, weights=weights, input_activations=acts, format="int-quantized")

    config_groups = {_group_name(spec): scheme(spec, targets) for spec, targets in groups.items()}
    formats = {group.format for group in config_groups.values()}
    config = QuantizationConfig(config_groups=config_groups, quantization_status="compressed", ignore=[],
                                format=formats.pop() if len(formats) == 1 else "mixed-precision")
    return {"quant_method": "compressed-tensors", **config.model_dump(exclude={"quant_method"}, mode="json")}


def _compress(model, params: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: QuantSpec,
              tensors: dict[str, torch.Tensor]) -> list[str]:
    """Add the compressed-tensors tensors of `params` (in-memory name -> (signed codes, scales)) to `tensors`
    under checkpoint names; returns the checkpoint module names."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = _to_disk(model, {name: q for name, (q, _) in params.items()})
    scales = _to_disk(model, {name: scale for name, (_, scale) in params.items()})
    modules = []
    for key, q in codes.items():
        module = key.removesuffix(".weight")
        if spec.bits == 4:
            tensors[f"{module}.weight_packed"] = pack_to_int32(q, 4).contiguous()
            tensors[f"{module}.weight_shape"] = torch.tensor(q.shape)
        else:
            tensors[f"{module}.weight"] = q
        # revert_weight_conversion squeezes per-expert chunks, so a one-group scale comes back 1-D.
        tensors[f"{module}.weight_scale"] = scales[key].reshape(q.shape[0], -1).contiguous()
        modules.append(module)
    return modules


def export_compressed_tensors(model, tokenizer, adapter: MoEAdapter, layer_schemes: list[str], out: str | Path,
                              group_size: int = W4_GROUP_SIZE) -> dict[str, torch.Tensor]:
    """Write `model` (fp32, smoothing already folded in) as a compressed-tensors checkpoint in `out`.

    Routed experts and shared expert of layer l use layer_schemes[l]: "w4a16" (4-bit symmetric, groups of
    `group_size` input columns, or the layer's narrowest input width when smaller) or "w8a8" (int8 per-channel
    weights, dynamic per-token int8 activations). Attention projections use w8a8; router, embeddings, norms and
    lm_head stay in float32. The folder is written as a temporary sibling and renamed into place.
    Returns the reference state: the model's state dict (in-memory names) with every quantized weight replaced
    by hexq's dequantized weight, which a correct loader must reproduce.
    """
    from safetensors.torch import save_file
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    out = Path(out)
    plan = _plan(model, adapter, layer_schemes, group_size)
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    reference = dict(state)
    by_spec: dict[QuantSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, spec in plan.items():
        codes, scales, reference[name] = _quantize_param(state[name], spec)
        by_spec.setdefault(spec, {})[name] = (codes, scales)

    tensors = _to_disk(model, remove_tied_weights_from_state_dict(
        {name: tensor for name, tensor in state.items() if name not in plan}, model))
    groups = {spec: _targets(sorted(_compress(model, params, spec, tensors))) for spec, params in by_spec.items()}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = _quantization_config(groups)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        # A previous export is moved aside, not deleted first, so `out` never holds a partial checkpoint.
        old = out.with_name(tmp.name + ".old") if out.exists() else None
        if old is not None:
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return reference


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HexqError(f"{folder} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _names(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:8]) + (f" (and {len(keys) - 8} more)" if len(keys) > 8 else "")


def load_exported(folder: str | Path, dtype: torch.dtype = torch.float32):
    """A compressed-tensors checkpoint as a normal dense model on CPU, verified against the file.

    Raises HexqError when transformers reports missing or unexpected keys, or when any weight of the loaded
    model differs from the dequantized checkpoint tensor of the same (original-format) name: a weight that
    was never loaded keeps its random initialisation and no logits check is needed to catch it.
    """
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the library does not print; callers show their own progress
    folder = Path(folder)
    try:
        # validate() also rejects quantization params no config group targets.
        dense = CompressedTensorsDequantizer(folder, dtype=dtype).validate(_read_checkpoint(folder))
    except ValueError as exc:
        raise HexqError(f"cannot dequantize {folder}: {exc}") from None
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    del config.quantization_config  # the tensors are dense now
    # The concrete class: the Auto class wants a path, and a state_dict excludes one.
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model, info = model_class.from_pretrained(None, config=config, state_dict=dense, dtype=dtype,
                                              output_loading_info=True)
    model.eval()
    if info["missing_keys"] or info["unexpected_keys"]:
        raise HexqError(f"{folder} does not match the {config.model_type} layout: missing (left at random "
                        f"initialisation): {_names(info['missing_keys']) or 'none'}; unexpected (ignored): "
                        f"{_names(info['unexpected_keys']) or 'none'}")

    # Map the loaded model back to checkpoint names and compare every tensor with the file.
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    loaded = _to_disk(model, state)
    left_out, ignored = loaded.keys() - dense.keys(), dense.keys() - loaded.keys()
    differ = [key for key in loaded.keys() & dense.keys() if not torch.equal(loaded[key], dense[key].to(dtype))]
    if left_out or ignored or differ:
        raise HexqError(f"{folder} did not load faithfully: not in the file: {_names(left_out) or 'none'}; "
                        f"not loaded: {_names(ignored) or 'none'}; different after loading: "
                        f"{_names(differ) or 'none'}")
    return model
