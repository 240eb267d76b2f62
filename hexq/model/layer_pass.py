"""Every window through one materialized layer (`run_layer`), and a whole model streamed layer by layer
(`stream_layers`, `stream_nll`) with the layer plan that says how each layer's routed experts are
computed (`ExpertCompute`; `full_precision_plan` for the checkpoint's own model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.hidden import HiddenStore
from hexq.model.simulate import routed_outputs
from hexq.model.streaming import LoadedLayer, Progress, StreamedModel

# Bytes of compute-ready expert weights materialized at once when experts are computed one chunk at a time.
EXPERT_CHUNK_BYTES = 512 * 2**20


def expert_chunk(gate_up_shape: tuple[int, int], down_shape: tuple[int, int], dtype: torch.dtype,
                 budget_bytes: int = EXPERT_CHUNK_BYTES) -> int:
    """How many experts fit in `budget_bytes` when materialized in `dtype` (at least one)."""
    per_expert = (gate_up_shape[0] * gate_up_shape[1] + down_shape[0] * down_shape[1]) * torch.finfo(dtype).bits // 8
    return max(1, budget_bytes // per_expert)


def stored_weights(loaded: LoadedLayer, device: torch.device, dtype: torch.dtype):
    """weights_of for a layer's own (full-precision) experts: the chunk upcast from the stored dtype."""

    def weights_of(experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = loaded.experts_of(experts)
        return gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype)

    return weights_of


@dataclass(frozen=True)
class ExpertCompute:
    """How a streamed layer's routed experts are computed: compute-ready weights per chunk of expert ids, the
    activation quantizers of their inputs, the chunk size, and which experts are computed at all (kept [E] bool,
    None: all; a skipped expert's routing weight goes to the token's kept experts, hexq.model.simulate.routed_outputs);
    accumulate: the dtype their combined output is summed in (None: the activations')."""

    weights_of: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]
    input_quant: object | None = None
    mid_quant: object | None = None
    chunk: int = 1
    kept: torch.Tensor | None = None
    accumulate: torch.dtype | None = None


@torch.no_grad()
def run_layer(loaded: LoadedLayer, hidden: HiddenStore, kwargs: list[dict], out: HiddenStore | None,
              experts: ExpertCompute | None, progress: Callable[[int, int], None] | None = None):
    """Every batch of `hidden` through the materialized layer, outputs appended to `out` (None: a pass whose
    outputs are not needed, e.g. one that only feeds hooks). On a MoE layer the routed experts' output is added
    expert by expert (hexq.model.simulate.routed_outputs) when `experts` is given; returns what the experts received
    (hexq.model.simulate.RoutedTokens), or None on a dense layer."""
    device = next(loaded.module.parameters()).device
    for index in range(len(hidden)):
        result = loaded.module(hidden[index].to(device), **kwargs[index])
        if out is not None:
            out.append(result[0] if isinstance(result, tuple) else result)
    if not loaded.is_moe:
        return None
    routed = loaded.tap.take()
    if experts is not None and out is not None:
        y = routed_outputs(routed, experts.weights_of, loaded.act_fn, experts.input_quant, experts.mid_quant,
                           experts.chunk, progress, experts.kept, accumulate=experts.accumulate).to(routed.x.dtype)
        start = len(out) - len(hidden)
        for offset, part in enumerate(routed.split(y)):
            current = out[start + offset]
            out[start + offset] = current + part.reshape(current.shape)
    return routed


LayerPlan = Callable[[LoadedLayer], "ExpertCompute | None"]


@torch.no_grad()
def stream_layers(streamed: StreamedModel, windows: torch.Tensor, batch_size: int, prepare: LayerPlan,
                  activation_limit: int | None = None, spill_dir: Path | None = None,
                  progress: Progress | None = None) -> HiddenStore:
    """The last decoder layer's outputs for windows [N, L] (one entry per batch), every window through layer l
    before layer l+1 is read. prepare(loaded) makes a materialized layer compute as the evaluated model does (e.g.
    quantized weights) and says how its routed experts are computed; the source's own experts are read only if
    prepare.reads_experts. The caller closes the returned store."""
    reads_experts = getattr(prepare, "reads_experts", False)
    hidden = HiddenStore(activation_limit, spill_dir)
    try:
        kwargs = streamed.layer_inputs(windows, batch_size, hidden)
        for index in range(streamed.num_layers):
            with streamed.layer(index, experts=reads_experts) as loaded:
                experts = prepare(loaded)
                outputs = HiddenStore(activation_limit, spill_dir)
                run_layer(loaded, hidden, kwargs, outputs, experts)
            hidden.close()
            hidden = outputs
            if progress:
                progress("layers", index + 1, streamed.num_layers)
    except BaseException:
        hidden.close()
        raise
    return hidden


def stream_nll(streamed: StreamedModel, windows: torch.Tensor, batch_size: int, prepare: LayerPlan,
               activation_limit: int | None = None, spill_dir: Path | None = None,
               progress: Progress | None = None) -> torch.Tensor:
    """Summed next-token NLL of each window [N] (float64), streamed (see stream_layers)."""
    hidden = stream_layers(streamed, windows, batch_size, prepare, activation_limit, spill_dir, progress)
    try:
        return streamed.head_nll(hidden, windows, batch_size)
    finally:
        hidden.close()


def full_precision_plan(streamed: StreamedModel) -> LayerPlan:
    """The checkpoint's own model: experts upcast chunk by chunk to the compute dtype."""

    def prepare(loaded: LoadedLayer) -> ExpertCompute | None:
        if not loaded.is_moe:
            return None
        _num, gate_up_shape, down_shape = loaded.shapes
        chunk = expert_chunk(gate_up_shape, down_shape, streamed.dtype)
        return ExpertCompute(stored_weights(loaded, streamed.device, streamed.dtype), chunk=chunk)

    prepare.reads_experts = True
    return prepare
