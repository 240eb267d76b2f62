"""`hexq pack --bank export` of a calibration made with `--export-target gguf`: the K-quant replicas the GGUF export
will write, and nothing more. A layer whose allocation makes it a Q2_K or Q3_K layer (hexq.gguf.plan.layer_type, the
rule `hexq export --format gguf` applies) keeps every non-skipped expert's replica of that K-quant, as its blocks.
"""

from __future__ import annotations

import torch

from hexq.artifact.format import PROJECTIONS
from hexq.calib.store import kquant_bank_key
from hexq.gguf.export import kquant_key
from hexq.gguf.plan import layer_type


def kquant_export(bank, allocation: list[int], symmetric: bool) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """(tensors for the layer's export shard, {K-quant: experts kept}) from an open calibration bank."""
    keys = set(bank.keys())
    fits = all(any(key.startswith(f"gguf.{p}.") for key in keys) for p in PROJECTIONS)
    kind = layer_type(allocation, symmetric, fits)
    if not fits or kind.block != 256:
        return {}, {}
    experts = [e for e, bits in enumerate(allocation) if bits]
    tensors = {kquant_key(e, kind.name, p): bank.get_slice(kquant_bank_key(p, kind.name))[e]
               for e in experts for p in PROJECTIONS}
    return tensors, {kind.name: experts}
