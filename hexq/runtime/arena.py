"""Every routed expert of a layer in one arena on the GPU as packed codes, computed with one launch per projection.

When the device is CUDA, Triton is there, the policy is static and the budget holds every expert at its allocated
width, the fast tier is one PackedArena per MoE layer (hexq.packed.triton): the stored codes, scales and zeros of all
its experts, and per expert a table entry (where its gate_up and down start, its width; width 0 for a skipped
expert). A forward pass looks the table up with the router's own choice of experts, on the device, and runs the
pair GEMV for all (token, slot) pairs at once: no host synchronisation, no Python loop over experts, mixed widths in
one launch. A skipped expert's pairs get weight 0 and their routing weight goes to the token's kept experts
(hexq.model.simulate.served_weights, as `hexq eval` computes it).
"""

from __future__ import annotations

import functools

import torch

from hexq.artifact.reader import Artifact
from hexq.model.simulate import ActQuantizer, served_weights
from hexq.packed import triton as gpu


class ExpertArena:
    """One MoE layer's experts in one arena on `device` (see the module docstring)."""

    def __init__(self, artifact: Artifact, row: int, device: torch.device, read_buffer: torch.Tensor) -> None:
        self.shapes = artifact.expert_shapes
        group = artifact.group_size
        self.groups = [group or cols for _rows, cols in self.shapes]
        widths = artifact.allocation[row]
        code_bytes = params = 0
        for bits in widths:
            for (rows, cols), group_size in zip(self.shapes, self.groups, strict=True):
                code_bytes += -(-rows * cols * bits // 8)
                params += rows * (cols // group_size) if bits else 0
        self.arena = gpu.PackedArena(code_bytes, params, device)
        code_offset = torch.zeros(2, len(widths), dtype=torch.int64, device="cpu")
        param_offset = torch.zeros(2, len(widths), dtype=torch.int64, device="cpu")
        for expert, bits in enumerate(widths):
            if not bits:
                continue
            for projection, weight in enumerate(artifact.read_expert(row, expert, bits, read_buffer)):
                code_offset[projection, expert], param_offset[projection, expert] = self.arena.add(
                    weight.codes.to(device), weight.scale.to(device), weight.zero.to(device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the read buffer is reused by the next expert
        self.code_offset, self.param_offset = code_offset.to(device), param_offset.to(device)
        self.bits = torch.tensor(widths, dtype=torch.int32, device=device)
        self.num_experts = len(widths)
        # (token, slot) pairs routed to a skipped expert, counted on the device (read by --stats, never per step)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, act_fn,
                 quantizers) -> torch.Tensor:
        """The layer's routed experts' combined output [T, H] for hidden_states [T, H] (what the family's experts
        module returns), every (token, slot) pair through its expert's codes."""
        input_quant, mid_quant = quantizers
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1).long()
        valid = (experts >= 0) & (experts < self.num_experts)  # some families mark dropped slots out of range
        experts = torch.where(valid, experts, torch.zeros_like(experts))
        bits = self.bits[experts]
        self.skipped += ((bits == 0) & valid).sum()
        weights = served_weights(top_k_index, top_k_weights, (bits > 0).view(tokens, k), self.num_experts)
        weights = weights.reshape(-1).float()
        x, grid = kernel_input(hidden_states.float().repeat_interleave(k, dim=0), input_quant)
        hidden = gpu.pair_gemv(x, self.arena, self.code_offset[0, experts], self.param_offset[0, experts], bits,
                               self.shapes[0], self.groups[0], grid)
        gate, up = hidden.chunk(2, dim=-1)
        mid, grid = kernel_input(act_fn(gate) * up, mid_quant)
        y = gpu.pair_gemv(mid, self.arena, self.code_offset[1, experts], self.param_offset[1, experts], bits,
                          self.shapes[1], self.groups[1], grid)
        return (y * weights[:, None]).view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def kernel_input(x: torch.Tensor, quantizer: ActQuantizer | None) -> tuple[torch.Tensor, tuple | None]:
    """(x, the pair GEMV's grid argument) for an input the recipe quantizes with `quantizer`: a 2-8 bit grid is put
    on x inside the GEMV's own launch (kernel_grid), any other is applied here first."""
    if quantizer is None:
        return x, None
    if not 2 <= quantizer.bits <= 8:
        return quantizer(x), None
    return x, kernel_grid(quantizer)


@functools.cache
def kernel_grid(quantizer: ActQuantizer) -> tuple[int, int, float, float]:
    """(GRID mode, qmax, scale, zero) of hexq.packed.triton's pair GEMV for a 2-8 bit ActQuantizer: per token, or a
    static grid whose scale and zero are computed once on the host by grid_params, as ActQuantizer computes them."""
    qmax = (1 << quantizer.bits) - 1
    if quantizer.dynamic:
        return (gpu.GRID_SYMMETRIC if quantizer.symmetric else gpu.GRID_ASYMMETRIC), qmax, 1.0, 0.0
    scale, zero = quantizer.static_grid("cpu")
    return gpu.GRID_STATIC, qmax, float(scale[0]), float(zero[0])


def linear_from_codes(x: torch.Tensor, weight, quantizer: ActQuantizer | None, table: torch.Tensor,
                      bits: torch.Tensor) -> torch.Tensor:
    """x [n, in] float32 through one packed matrix W [out, in] (every row a pair on it: `table` a one-entry device
    tensor of offset 0, `bits` its width), x on the quantizer's grid inside the same launch: [n, out] float32."""
    x, grid = kernel_input(x, quantizer)
    return gpu.pair_gemv(x, weight, table, table, bits, weight.shape, weight.shape[1] // weight.scale.shape[-1], grid)
