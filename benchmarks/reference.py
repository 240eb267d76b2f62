"""What the tests, benchmarks and scripts compare hexq with, and nothing the library runs: a whole checkpoint loaded
into memory by transformers (the reference the streamed paths must match, and the peers' input), its router's
choices captured with forward hooks, the logits of a streamed pass, and the importance-blind allocation baseline.

The router of every supported family returns (router_logits, router_scores, router_indices); the hooks read the
chosen expert ids and their scores, and are removed when the block ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.devices import resolve_device
from hexq.base.errors import HexqError
from hexq.calib.capture import add_routing
from hexq.model.adapters import MoEAdapter
from hexq.model.folder import check_moe_folder
from hexq.model.layer_pass import LayerPlan, stream_layers
from hexq.model.streaming import StreamedModel


def load_model(folder: str | Path, device: str | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, adapter) from a local folder, offline, in eval mode and `dtype` (fp32 by default:
    the reference weights are stored in bf16 and every hexq computation runs on their fp32 upcast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the library does not print; callers show their own progress
    folder = Path(folder)
    adapter = check_moe_folder(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    except OSError as exc:
        raise HexqError(f"cannot load model from {folder}: {str(exc).splitlines()[0]}") from None
    model.to(resolve_device(device)).eval()
    return model, tokenizer, adapter


@torch.no_grad()
def stream_logits(streamed: StreamedModel, windows: torch.Tensor, prepare: LayerPlan,
                  batch_size: int = 8) -> torch.Tensor:
    """Logits [N, L, vocab] (float32) of windows, streamed: for checks on small models and few windows."""
    hidden = stream_layers(streamed, windows, batch_size, prepare)
    try:
        with streamed.parts("model.norm", "lm_head"):
            norm, head = streamed.model.model.norm, streamed.model.lm_head
            return torch.cat([head(norm(h.to(streamed.device))).float().cpu() for h in hidden])
    finally:
        hidden.close()


def moe_routers(model, adapter: MoEAdapter) -> list[torch.nn.Module]:
    return [getattr(getattr(layer, adapter.moe), adapter.router) for layer in model.model.layers]


@contextmanager
def on_router_calls(model, adapter: MoEAdapter, record: Callable[[int, torch.Tensor, torch.Tensor], None]):
    """Within the block, every router call runs record(layer_index, scores, indices); hooks removed in `finally`."""

    def hook_for(layer_index: int):
        def hook(_module, _inputs, outputs):
            _logits, scores, indices = outputs
            record(layer_index, scores, indices)

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(moe_routers(model, adapter))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class RouterCounts:
    """Per layer and expert: how many tokens chose the expert, and the sum of their routing scores."""

    counts: torch.Tensor  # [L, E] int64
    score_sums: torch.Tensor  # [L, E] float64

    @property
    def load(self) -> torch.Tensor:
        """Share of each layer's routed (token, slot) pairs that went to each expert; rows sum to 1."""
        return self.counts.double() / self.counts.sum(dim=1, keepdim=True).clamp(min=1)


@contextmanager
def capture_router_counts(model, adapter: MoEAdapter, num_experts: int):
    """Within the block, every forward pass adds its routing decisions to the yielded RouterCounts."""
    layers = len(moe_routers(model, adapter))
    stats = RouterCounts(torch.zeros(layers, num_experts, dtype=torch.long, device="cpu"),
                         torch.zeros(layers, num_experts, dtype=torch.float64, device="cpu"))

    def record(layer: int, scores: torch.Tensor, indices: torch.Tensor) -> None:
        add_routing(stats.counts[layer], stats.score_sums[layer], scores, indices)

    with on_router_calls(model, adapter, record):
        yield stats


@contextmanager
def capture_router_topk(model, adapter: MoEAdapter):
    """Within the block, every router call appends its chosen expert ids ([T, k], int16 like the calibration
    store's router.topk) to its layer's list. After the block, `stack_trace(calls)` is the
    trace [L, T, k]: each forward pass runs every layer's router once on the same tokens in the same order, so row t
    of every layer is the same token and a token's path is read down the layer axis."""
    traces: list[list[torch.Tensor]] = [[] for _ in moe_routers(model, adapter)]

    def record(layer: int, _scores: torch.Tensor, indices: torch.Tensor) -> None:
        traces[layer].append(indices.reshape(-1, indices.shape[-1]).to(torch.int16).cpu())

    with on_router_calls(model, adapter, record):
        yield traces


def stack_trace(calls: list[list[torch.Tensor]]) -> torch.Tensor:
    """Per layer, a list of router calls [T_i, k] -> trace [L, T, k] (what `capture_router_topk` records)."""
    layers = [torch.cat(layer_calls) if layer_calls else torch.zeros(0, 0, dtype=torch.int16, device="cpu")
              for layer_calls in calls]
    if len({tuple(layer.shape) for layer in layers}) != 1:
        shapes = ", ".join(str(tuple(layer.shape)) for layer in layers)
        raise ValueError(f"layers saw different tokens ({shapes}); a trace needs every layer to route the same ones")
    return torch.stack(layers)


def shuffled_like(bits_per_expert: Sequence[int], seed: int) -> list[int]:
    """Importance-blind baseline: the same widths (same histogram, same budget) randomly permuted across experts."""
    perm = torch.randperm(len(bits_per_expert), generator=torch.Generator().manual_seed(seed), device="cpu")
    return [int(bits_per_expert[i]) for i in perm.tolist()]
