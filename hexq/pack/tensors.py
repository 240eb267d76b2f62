"""What one layer contributes to an artifact, sliced from a calibration folder (hexq.pack.stage writes it).

Dense part: quantized linears as the calibration's packed codes with their static activation ranges, everything
else as stored. Routed experts: the replicas of each expert's stored widths, read row by row from the calibration's
packed bank (a safetensors slice: the other experts' rows are never read), and the replicas the exports need (the
EXPORT_BITS-bit GPTQ replica of an expert whose width has no exact export form; the K-quant blocks of a GGUF
layer).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from hexq.algos.gguf_layers import layer_type
from hexq.algos.kquant import KQUANTS
from hexq.artifact.format import kquant_key, replica_key
from hexq.calib.capture import quantized_linears
from hexq.calib.store import bank_prefix, kquant_bank_key, open_bank
from hexq.packed.grids import EXPORT_BITS, scheme_fits
from hexq.packed.weight import PROJECTIONS


def stored_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A non-quantized tensor as stored: bfloat16 when that is exact, else float32 (integers as they are)."""
    if not tensor.is_floating_point():
        return tensor.detach().cpu()
    as_bf16 = tensor.detach().to(torch.bfloat16)
    return (as_bf16 if torch.equal(as_bf16.float(), tensor.detach().float()) else tensor.detach().float()).cpu()


def dense_layer_tensors(loaded, adapter, calibration: dict, prefix: str, bits: int) -> tuple[dict, dict[str, int]]:
    """One materialized layer's non-expert tensors for the artifact (smoothing folded by the caller): quantized
    linears as the calibration's packed codes plus static activation ranges, everything else `stored_tensor`;
    returns the tensors and {quantized weight name: bits}."""
    out: dict[str, torch.Tensor] = {}
    quantized: dict[str, int] = {}
    linears = quantized_linears(loaded.module, adapter)
    for name in linears:
        for part in ("codes", "scale", "zero"):
            out[f"{prefix}{name}.weight.{part}"] = calibration[f"linear.{name}.{part}"]
        quantized[f"{prefix}{name}.weight"] = bits
        if f"act.{name}" in calibration:
            out[f"{prefix}{name}.act_range"] = calibration[f"act.{name}"].float()
    skip = {f"{name}.weight" for name in linears}
    for name, tensor in loaded.module.state_dict().items():
        if name not in skip:
            out[prefix + name] = stored_tensor(tensor)
    return out, quantized


def layer_expert_tensors(bank, layer, widths_of: list[set[int]]) -> tuple[dict, dict[int, int]]:
    """One MoE layer's stored replicas: expert e at each width in widths_of[e], sliced from the calibration's
    packed bank (a safe_open handle: only those rows are read), plus the layer's static expert activation ranges
    (from `layer`, the layer file's handle); returns tensors and stored bytes per width."""
    out: dict[str, torch.Tensor] = {}
    nbytes: dict[int, int] = {}
    for expert, widths in enumerate(widths_of):
        for bits in sorted(widths):
            for projection in PROJECTIONS:
                prefix = bank_prefix(projection, bits)
                for part in ("codes", "scale", "zero"):
                    tensor = bank.get_slice(f"{prefix}.{part}")[expert]
                    out[f"{replica_key(expert, bits, projection)}.{part}"] = tensor
                    nbytes[bits] = nbytes.get(bits, 0) + tensor.numel() * tensor.element_size()
    for name, key in (("input", "act.experts.input"), ("mid", "act.experts.mid")):
        if key in layer.keys():
            out[f"act.{name}"] = layer.get_tensor(key).float()
    return out, nbytes


def export_replica_experts(row: list[int], symmetric: bool, float_zero_bits: Collection[int] = ()) -> list[int]:
    """Experts of one MoE layer whose allocated width has no exact EXPORT_BITS-bit form (scheme_fits): `hexq export`
    writes their EXPORT_BITS-bit GPTQ replica in their place in a 4-bit layer."""
    return [e for e, bits in enumerate(row) if not scheme_fits(bits, symmetric, EXPORT_BITS, float_zero_bits)]


def layer_export_tensors(bank, experts: list[int], bits: int, own_grid: bool) -> dict[str, torch.Tensor]:
    """The `bits` replicas of `experts` (hexq.artifact.format.export_shard's layout: the keys of
    layer_expert_tensors), sliced from the calibration's packed bank (own_grid) or from its export-target bank
    (`export.<proj>.b<bits>`, hexq.calib.quantize.export_spec)."""
    out: dict[str, torch.Tensor] = {}
    for expert in experts:
        for projection in PROJECTIONS:
            prefix = bank_prefix(projection, bits, export=not own_grid)
            for part in ("codes", "scale", "zero"):
                out[f"{replica_key(expert, bits, projection)}.{part}"] = bank.get_slice(f"{prefix}.{part}")[expert]
    return out


def layer_kquant_tensors(bank, allocation: list[int], symmetric: bool) -> tuple[dict[str, torch.Tensor],
                                                                               dict[str, list[int]]]:
    """The K-quant replicas `hexq export --format gguf` will write for one MoE layer, from a calibration made with
    `--export-target gguf` (an open bank): a layer whose allocation makes it a Q2_K or Q3_K layer (the export's rule,
    hexq.algos.gguf_layers.layer_type) keeps every non-skipped expert's replica of that K-quant, as its blocks.
    Returns the tensors for the layer's export shard and {K-quant: experts kept}."""
    keys = set(bank.keys())
    fits = all(any(kquant_bank_key(p, kind) in keys for kind in KQUANTS) for p in PROJECTIONS)
    kind = layer_type(allocation, symmetric, fits).name
    if not fits or kind not in KQUANTS:
        return {}, {}
    experts = [e for e, bits in enumerate(allocation) if bits]
    tensors = {kquant_key(e, kind, p): bank.get_slice(kquant_bank_key(p, kind))[e]
               for e in experts for p in PROJECTIONS}
    return tensors, {kind: experts}


def export_grid(calib_dir: Path, layer: int, cols: int, group_size: int | None,
                symmetric: bool) -> tuple[int | None, bool, bool]:
    """(group size, symmetric, own grid) of a calibration's export replicas: its export-target bank's grid (vLLM's:
    symmetric, hexq.calib.quantize.export_spec) when it has one, else its own replica grid. cols: gate_up's input
    width."""
    with open_bank(calib_dir, layer) as handle:
        key = f"{bank_prefix('gate_up', EXPORT_BITS, export=True)}.scale"
        if key not in handle.keys():
            return group_size, symmetric, True
        groups = handle.get_slice(key).get_shape()[-1]
    return cols // groups, True, False
