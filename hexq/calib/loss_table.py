"""Pass C of calibration (hexq.calib.pipeline): the quantized layer runs again; what its experts received gives the
loss table L(l, e, b), the output MSE of each replica against the full-precision expert on the tokens routed to it
(002 §4.2), and the experts' output at `propagate_bits`, which makes the next layer's inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hexq.calib.ranks import SINGLE, Ranks
from hexq.model.layer_pass import expert_chunk
from hexq.model.simulate import (
    RoutedTokens,
    expert_output,
    loss_sample,
    quantized_expert_output,
    routed_outputs,
    skipped_output,
)

Progress = Callable[[str, int, int], None]  # (what, done, total)

# Intermediate activations of one expert computed at once for the loss table and the propagated output.
LOSS_TABLE_BYTES = 256 << 20
# Full-precision experts upcast at once on the CPU (float32). The table holds a chunk of them and the same chunk's
# replicas at one width, each with its gather/dequantization transients; the work is per expert whatever the chunk,
# so a small one costs no time. At the layer-pass chunk (512 MiB) this pass set calibration's peak RSS: 5.1 GiB for
# a Qwen3-30B-A3B-shaped layer at 32 windows, against 2.9 GiB for everything before it.
LOSS_CHUNK_BYTES = 64 << 20


# ------------------------------------------------------------------------------------------ pass C: loss table


def loss_chunk(gate_up_shape: tuple[int, int], down_shape: tuple[int, int], chunk: int, device: torch.device) -> int:
    """Experts per chunk of the loss table: at most LOSS_CHUNK_BYTES of them in float32 on the CPU; on a GPU the
    layer pass's `chunk` (fewer, larger reads from the bank; the device has the room)."""
    if device.type == "cuda":
        return chunk
    return min(chunk, expert_chunk(gate_up_shape, down_shape, torch.float32, LOSS_CHUNK_BYTES))


def squared_error(output: torch.Tensor, reference: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_t weight_t ||output_t - reference_t||^2 in float64, for rows [n, H] and per-row weights [n]."""
    return ((output - reference).pow(2).sum(dim=-1, dtype=torch.float64) * weight.double()).sum()


@torch.no_grad()
def loss_table(routed: RoutedTokens, weights_of, tensors: dict, replicas, bits_list: tuple[int, ...],
               propagate_bits: int, quantizers: tuple, moe_sample: torch.Tensor, act_fn, chunk: int,
               loss_tokens: int, progress: Progress | None, ranks: Ranks = SINGLE,
               weighted: bool = False) -> torch.Tensor:
    """Fill tensors["loss_table"] [E, len(bits_list)] with the output MSE of each replica against the
    full-precision expert on (at most loss_tokens of) the tokens routed to it (002 §4.2), tensors["loss_table.skip"]
    [E] with the MSE of skipping it (004's 0 bits, measured like a replica: skipping renormalises the token's other
    routing weights, which is the same as replacing the expert's output by the weighted mean of the token's other
    experts, hexq.model.simulate.renormalized_weights), tensors["loss_table.mass"] [E] with each expert's summed squared
    routing weight per layer token (how much of the layer's output error one unit of its MSE is); return the
    experts' combined output [T, H] at the propagated width, computed on every routed token. weighted
    (experts.token_weights "routing"): each measured token's squared error weighted by its squared routing weight over
    their mean (RoutedTokens.scales), the weighting the expert's GPTQ Hessians had.

    Working set: a chunk of full-precision experts, the same chunk's replicas at one width (read from the bank when
    needed, so a bank of five widths is never dequantized at once), each expert's reference outputs on its measured
    rows, a bounded number of token rows, and the full-precision experts' combined output [T, H] (what the skip
    entries are measured against). replicas(bits, experts) reads a chunk's replicas at one width from the layer's bank
    (calib.calibrated.bank_replicas).

    Across ranks (hexq.calib.ranks) each rank measures the rows of its own experts and their part of both combined
    outputs; the parts and the rows are summed (Ranks.sum), so every rank returns the same table and output."""
    num_experts = routed.num_experts
    device = routed.x.device  # the sums stay on the device until the table is complete: no synchronisation per expert
    sse = torch.zeros(num_experts, len(bits_list), dtype=torch.float64, device=device)
    skip_sse = torch.zeros(num_experts, dtype=torch.float64, device=device)
    tokens = torch.tensor([routed.count(e) for e in range(num_experts)], dtype=torch.long, device="cpu")
    measured = torch.zeros(num_experts, dtype=torch.long, device="cpu")  # rows each MSE is averaged over
    valid = (routed.index >= 0) & (routed.index < num_experts)
    slot_weights = routed.weights.masked_fill(~valid, 0).float()
    token_mass = slot_weights.sum(dim=1)  # S_t: the routing mass the token's experts share
    squared = torch.zeros(num_experts, dtype=torch.float64, device=device)
    squared.index_add_(0, routed.index[valid], slot_weights[valid].double().square())
    own = ranks.expert_range(tokens.tolist())
    # Both combined outputs are summed in float64: a token's few float32 terms then add exactly, so the result is the
    # same bits whichever experts each rank summed and in which order (one process or several, hexq.calib.ranks).
    fp_total = ranks.sum(routed_outputs(routed, weights_of, act_fn, None, None, chunk, only=own,
                                        accumulate=torch.float64)).to(routed.x.dtype)  # sum_j w_j y_j, full precision
    out = torch.zeros_like(routed.x, dtype=torch.float64)
    for start in range(own.start, own.stop, chunk):
        experts = list(range(start, min(start + chunk, own.stop)))
        fp_gate_up, fp_down = weights_of(experts)
        rows = max(1, LOSS_TABLE_BYTES // (4 * max(fp_gate_up.shape[1], fp_down.shape[1])))
        inputs, references = [], []
        for j, expert in enumerate(experts):
            token, slot = routed.rows(expert)
            x = routed.x[token] if len(token) else moe_sample  # never routed: measure on the layer's sample
            measure = loss_sample(x, loss_tokens)
            measured[expert] = measure.shape[0]
            sampled = routed.sampled_rows(expert, loss_tokens)  # the pairs measured
            weight = (routed.scales(*sampled).square() if weighted and len(token)
                      else torch.ones(measure.shape[0], device=device))
            reference = torch.cat([expert_output(part, fp_gate_up[j], fp_down[j], act_fn)
                                   for part in measure.split(rows)])
            stand_in = skipped_output(fp_total, token_mass, slot_weights, *sampled, reference)
            skip_sse[expert] = squared_error(stand_in, reference, weight)
            inputs.append((token, slot, x, measure, weight))
            references.append(reference)
        for b, bits in enumerate(bits_list):  # one width of the chunk's replicas at a time
            gate_ups, downs = replicas(bits, experts)
            for j, expert in enumerate(experts):
                token, slot, x, measure, weight = inputs[j]
                outputs = [expert_output(part, gate_ups[j], downs[j], act_fn) for part in measure.split(rows)]
                sse[expert, b] = sum(squared_error(y, ref, w) for y, ref, w in
                                     zip(outputs, references[j].split(rows), weight.split(rows), strict=True))
                if bits == propagate_bits and len(token):
                    # every routed row measured (loss_sample returned x) and the expert's activations not quantized:
                    # the propagated outputs are the measured ones, in the same parts
                    reuse = measure is x and quantizers == (None, None)
                    for i, (rows_of, slots, part) in enumerate(zip(token.split(rows), slot.split(rows), x.split(rows),
                                                                   strict=True)):
                        y = outputs[i] if reuse else quantized_expert_output(part, gate_ups[j], downs[j], act_fn,
                                                                              *quantizers)
                        out.index_add_(0, rows_of, (y * routed.weights[rows_of, slots, None]).double())
            del gate_ups, downs
        del fp_gate_up, fp_down, references
        if progress:
            progress("loss table", experts[-1] + 1 - own.start, len(own))
    # each row was measured by one rank (zeros elsewhere): summing is exact
    sse, skip_sse, measured, out = (ranks.sum(t) for t in (sse, skip_sse, measured, out))
    elements = measured.double() * routed.x.shape[1]
    tensors["loss_table"] = sse.cpu() / elements[:, None]
    tensors["loss_table.skip"] = skip_sse.cpu() / elements
    tensors["loss_table.mass"] = (squared / max(routed.x.shape[0], 1)).cpu()
    tensors["loss_table.tokens"] = tokens
    tensors["loss_table.bits"] = torch.tensor(bits_list, dtype=torch.int64, device="cpu")
    return out.to(routed.x.dtype)
