"""A decoder layer made to compute as calibrated: smoothing folded, dequantized dense weights with activation fake
quantization, routed experts read from the layer's bank at one width. Used by calibration itself (the next layer's
inputs, resuming) and by `hexq eval CALIBRATION` (calibrated_model)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hexq.artifact.format import HEAD_WEIGHT
from hexq.base.errors import HexqError
from hexq.calib.capture import (
    quantized_linears,
)
from hexq.calib.fold import fold_calibrated
from hexq.calib.head import HEAD_PREFIX
from hexq.calib.quantize import default_expert_bits
from hexq.calib.store import (
    CalibrationManifest,
    bank_weights,
    calibration_source,
    load_head,
    load_layer,
    open_bank,
    packed_matrix,
    read_manifest,
)
from hexq.config.recipe import Recipe
from hexq.model.adapters import MoEAdapter
from hexq.model.layer_pass import ExpertCompute, expert_chunk
from hexq.model.simulate import (
    act_quantizer,
    attach_input_quant,
)
from hexq.model.streaming import LoadedLayer, open_model
from hexq.packed.weight import PROJECTIONS, PackedWeight, dequantize_packed

# Working memory for one chunk of experts' GPTQ (weights of every width stacked, Hessians and factors, float32).

# ------------------------------------------------------------------------------------------ applying a layer


@torch.no_grad()
def apply_dense_part(loaded: LoadedLayer, adapter: MoEAdapter, tensors: dict, recipe: Recipe, fold: bool) -> None:
    """Make the materialized layer's dense part compute as quantized: (fold the smoothing factors,) dequantized
    weights and activation fake quantization on every quantized linear."""
    layer = loaded.module
    if fold:
        fold_calibrated(layer, adapter, tensors)
    for name, module in quantized_linears(layer, adapter).items():
        weight = dequantize_packed(packed_matrix(tensors, f"linear.{name}", tuple(module.weight.shape),
                                                 recipe.weights.bits))
        module.weight.copy_(weight.to(module.weight.dtype))
        quantizer = act_quantizer(recipe.activations, tensors.get(f"act.{name}"))
        if quantizer is not None:
            loaded.hooks.append(attach_input_quant(module, quantizer))


def bank_replicas(loaded: LoadedLayer, device: torch.device, folder: Path):
    """replicas(bits, experts) -> (gate_up, down): those experts' replicas at `bits`, dequantized in float32 on
    `device`, from the layer's bank file in `folder`. The bank is opened for each read, so its memory map is closed
    after each and the pages read never add up to the whole bank in the process's RSS."""
    _num, gate_up_shape, down_shape = loaded.shapes
    shapes = {"gate_up": gate_up_shape, "down": down_shape}

    def replicas(bits: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with open_bank(folder, loaded.index) as bank:
            return tuple(bank_weights(bank, p, bits, experts, shapes[p], torch.float32, device) for p in PROJECTIONS)

    return replicas


def calibrated_experts(loaded: LoadedLayer, tensors: dict, recipe: Recipe, bits: int, device: torch.device,
                       folder: Path) -> ExpertCompute:
    """The layer's routed experts as calibrated: the replica at `bits` read chunk by chunk from the layer's bank file
    in `folder`, with the recipe's activation quantization."""
    _num, gate_up_shape, down_shape = loaded.shapes
    setting = recipe.expert_activations
    return ExpertCompute(functools.partial(bank_replicas(loaded, device, folder), bits),
                         act_quantizer(setting, tensors.get("act.experts.input")),
                         act_quantizer(setting, tensors.get("act.experts.mid")),
                         expert_chunk(gate_up_shape, down_shape, torch.float32))




def calibration_plan(calib_dir: Path, expert_bits: int | None) -> tuple[CalibrationManifest, int]:
    """(manifest, expert width) of a finished calibration, after checking the source model is unchanged."""
    manifest = read_manifest(calib_dir)
    calibration_source(calib_dir, manifest)
    bits = default_expert_bits(manifest.recipe) if expert_bits is None else expert_bits
    if bits not in manifest.expert_bits:
        raise HexqError(f"{calib_dir} has expert replicas at {manifest.expert_bits} bits, not {bits}")
    return manifest, bits


class QuantizedHead:
    """A checkpoint (hexq.model.streaming.LayerSource) whose LM head reads as a calibration's quantized head,
    dequantized (float32); everything else is the checkpoint's."""

    def __init__(self, source, head: PackedWeight) -> None:
        self.source, self.head = source, head

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def has_param(self, name: str) -> bool:
        return name == HEAD_WEIGHT or self.source.has_param(name)

    def read_param(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return dequantize_packed(self.head) if name == HEAD_WEIGHT else self.source.read_param(name, shape)

    def param_dtype(self, name: str) -> torch.dtype | None:
        return torch.float32 if name == HEAD_WEIGHT else self.source.param_dtype(name)


def calibrated_model(calib_dir: str | Path, device: torch.device, expert_bits: int | None = None):
    """(streamed source model, tokenizer, prepare): the calibration's quantized model, layer by layer (smoothing
    folded, dequantized dense weights with activation quantization, experts at `expert_bits`, the quantized head when
    the recipe has one: a head of its own, as in the artifact)."""
    calib_dir = Path(calib_dir)
    manifest, bits = calibration_plan(calib_dir, expert_bits)
    recipe = manifest.recipe
    streamed, tokenizer = open_model(manifest.model_path, device)
    head = load_head(calib_dir, recipe)
    if head is not None:
        shape = (streamed.config.vocab_size, streamed.config.hidden_size)
        streamed.source = QuantizedHead(streamed.source, packed_matrix(head, HEAD_PREFIX, shape, recipe.head.bits))
        streamed.config.tie_word_embeddings = False

    def prepare(loaded: LoadedLayer) -> ExpertCompute | None:
        tensors, _ = load_layer(calib_dir, loaded.index)
        apply_dense_part(loaded, streamed.adapter, tensors, recipe, fold=True)
        return calibrated_experts(loaded, tensors, recipe, bits, device, calib_dir) if loaded.is_moe else None

    return streamed, tokenizer, prepare
