"""Feeding calibration windows through a model one decoder layer at a time.

`layer_inputs` runs the model's own embedding, mask and rotary code with the decoder stack swapped for a
pass-through module that records what the first layer would receive, so every family's mask and position
handling is reused rather than copied, and no layer runs. `run_layer` then carries the hidden states upward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerBatch:
    """One batch of calibration windows at the input of a decoder layer."""

    hidden: torch.Tensor  # [B, L, H]
    kwargs: dict  # attention mask, position ids and embeddings, as the model passes them to every layer


class _Recorder(torch.nn.Module):
    """Stands in for the decoder stack: records a layer's inputs and returns the hidden states unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[LayerBatch] = []

    def forward(self, hidden_states, **kwargs):
        kept = {k: v for k, v in kwargs.items() if k not in {"past_key_values", "use_cache"}}
        self.seen.append(LayerBatch(hidden_states, kept))
        return hidden_states


@torch.no_grad()
def layer_inputs(model, ids: torch.Tensor, batch_size: int) -> list[LayerBatch]:
    """Inputs of decoder layer 0 for every batch of calibration windows ids [N, L]."""
    base = model.model
    layers, recorder = base.layers, _Recorder()
    device = next(model.parameters()).device
    base.layers = torch.nn.ModuleList([recorder])  # a one-layer stack: the recorder runs once per batch
    try:
        for batch in ids.split(batch_size):
            base(input_ids=batch.to(device), use_cache=False)
    finally:
        base.layers = layers
    return recorder.seen


@torch.no_grad()
def run_layer(layer: torch.nn.Module, batches: list[LayerBatch]) -> list[LayerBatch]:
    """The layer's outputs as the next layer's inputs (same kwargs)."""
    out = []
    for batch in batches:
        hidden = layer(batch.hidden, **batch.kwargs)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        out.append(LayerBatch(hidden, batch.kwargs))
    return out
