"""GPU kernels on packed weights (Triton): a GEMV over (token, expert) pairs that reads each pair's matrix from one
arena of packed codes, whatever its width, so that a layer's routed experts take one launch per projection.

The pair GEMV. y[p, r] = sum_c W_p[r, c] x[p, c] for every pair p, W_p = (q - zero) * scale per group of GROUP codes,
q the `bits_p`-bit codes of one little-endian bit stream (hexq.packed.bitpack) that starts at byte code_offset[p] of
the codes arena; its float16 scale and zero start at element param_offset[p] of their arenas. Code i of a matrix sits
at stream bit i * bits: two byte loads and a shift give it for any width 1-8 (the arena is padded so that the second
load stays inside). The tables are device tensors indexed by the routing itself (experts chosen by the router on the
device), so a decode step has no host synchronisation and one launch covers every expert of a layer at mixed widths.
The same kernel computes a quantized dense linear: every row of x is a pair on the same matrix. Where the recipe
quantizes a matrix's input (W8A8), the kernel puts x on that activation grid itself (GRID: per token from the row's
range, or a static grid), so quantization and product are one launch, with the values torch's fake quantization gives
(hexq.model.simulate.ActQuantizer; tests/test_packed_triton.py holds them bit for bit).

Without a GPU, TRITON_INTERPRET=1 runs these kernels on the CPU (tests/test_packed_triton.py): the kernel math is
checked by the CI that has no GPU. Without triton installed, `available()` is False and CUDA serving expands
matrices with the torch path.
"""

from __future__ import annotations

import torch

from hexq.packed.weight import CODE_PAD

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: CUDA serving then expands matrices with torch ops
    triton = None

BLOCK_N = 32  # rows per program
BLOCK_K = 64  # columns per step
# How pair_gemv puts its input on an activation grid (W8A8) inside the launch: not at all, per token from the row's
# range (asymmetric or symmetric, hexq.algos.quant.grid_params), or on a static calibrated grid
GRID_NONE, GRID_ASYMMETRIC, GRID_SYMMETRIC, GRID_STATIC = 0, 1, 2, 3


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _grid_value(x, scale, zero, QMAX: tl.constexpr):
        """x on the activation grid (scale, zero): (clamp(round(x / scale + zero), 0, QMAX) - zero) * scale, rounded
        half to even as torch.round does (clamping first changes no code: the bounds are integers)."""
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale) + zero, 0.0), QMAX)
        v = (v + 8388608.0) - 8388608.0  # 2^23: float32 addition rounds v in [0, 2^22] to the nearest even integer
        return (v - zero) * scale

    @triton.jit
    def _pair_gemv(x_ptr, y_ptr, codes_ptr, scale_ptr, zero_ptr, code_off_ptr, param_off_ptr, bits_ptr,
                   rows, cols, x_stride, y_stride, table_stride, grid_scale, grid_zero,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GRID: tl.constexpr,
                   QMAX: tl.constexpr):
        pair = tl.program_id(0)
        row = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row < rows
        entry = pair * table_stride  # 0: every pair reads the same matrix (a dense linear)
        bits = tl.load(bits_ptr + entry).to(tl.int64)
        code_off = tl.load(code_off_ptr + entry)
        param_off = tl.load(param_off_ptr + entry)
        mask = (1 << bits) - 1
        groups = cols // GROUP
        if GRID == 1 or GRID == 2:  # GRID_ASYMMETRIC, GRID_SYMMETRIC: the input's per-token grid, from its whole row
            low = tl.zeros([BLOCK_K], dtype=tl.float32)
            high = tl.zeros([BLOCK_K], dtype=tl.float32)
            for start in range(0, cols, BLOCK_K):
                col = start + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + pair * x_stride + col, mask=col < cols, other=0.0).to(tl.float32)
                low, high = tl.minimum(low, x), tl.maximum(high, x)
            low, high = tl.min(low, axis=0), tl.max(high, axis=0)  # min(x, 0) and max(x, 0): the zeros above
            if GRID == 1:  # hexq.algos.quant.grid_params; -low / scale is in [0, QMAX]: rounded as in _grid_value
                grid_scale = tl.maximum(tl.math.div_rn(high - low, QMAX * 1.0), 1e-8)
                grid_zero = (tl.math.div_rn(-low, grid_scale) + 8388608.0) - 8388608.0
            else:
                grid_scale = tl.math.div_rn(2 * tl.maximum(tl.maximum(high, -low), 1e-8), QMAX * 1.0)
                grid_zero = (QMAX + 1) // 2 * 1.0
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, cols, BLOCK_K):
            col = start + tl.arange(0, BLOCK_K)
            col_ok = col < cols
            x = tl.load(x_ptr + pair * x_stride + col, mask=col_ok, other=0.0).to(tl.float32)
            if GRID != 0:  # GRID_NONE
                x = _grid_value(x, grid_scale, grid_zero, QMAX)
            ok = row_ok[:, None] & col_ok[None, :]
            bit = (row[:, None].to(tl.int64) * cols + col[None, :]) * bits
            byte = code_off + (bit >> 3)
            low_byte = tl.load(codes_ptr + byte, mask=ok, other=0).to(tl.int64)
            high_byte = tl.load(codes_ptr + byte + 1, mask=ok, other=0).to(tl.int64)
            q = ((low_byte | (high_byte << 8)) >> (bit & 7)) & mask
            param = param_off + row[:, None].to(tl.int64) * groups + col[None, :] // GROUP
            scale = tl.load(scale_ptr + param, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + param, mask=ok, other=0.0).to(tl.float32)
            acc += tl.sum((q.to(tl.float32) - zero) * scale * x[None, :], axis=1)
        tl.store(y_ptr + pair * y_stride + row, acc, mask=row_ok)


def pair_gemv(x: torch.Tensor, arena: PackedArena, code_offset: torch.Tensor, param_offset: torch.Tensor,
              bits: torch.Tensor, shape: tuple[int, int], group: int,
              grid: tuple[int, int, float, float] | None = None) -> torch.Tensor:
    """y [P, rows] float32 for x [P, cols]: pair p through the matrix the tables' entry p points at (tables of one
    entry: every pair through that one matrix). grid (mode, qmax, scale, zero): x put on an activation grid inside
    the same launch (GRID_*; scale and zero used by GRID_STATIC only; hexq.runtime.arena.kernel_grid makes it from
    the recipe's quantizer, with which it computes the same values)."""
    rows, cols = shape
    pairs = x.shape[0]
    y = torch.empty(pairs, rows, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return y
    mode, qmax, grid_scale, grid_zero = grid or (GRID_NONE, 1, 1.0, 0.0)
    x = x.contiguous()
    stride = 0 if code_offset.numel() == 1 else 1
    launch = (pairs, triton.cdiv(rows, BLOCK_N))
    _pair_gemv[launch](x, y, arena.codes, arena.scale, arena.zero, code_offset, param_offset, bits, rows, cols,
                       x.stride(0), y.stride(0), stride, grid_scale, grid_zero, GROUP=group, BLOCK_N=BLOCK_N,
                       BLOCK_K=BLOCK_K, GRID=mode, QMAX=qmax)
    return y


class PackedArena:
    """Packed matrices laid end to end on one device: codes (uint8, padded), scales and zeros (float16), and where
    each matrix starts. `add` appends one and returns (code offset, param offset)."""

    def __init__(self, code_bytes: int, params: int, device: torch.device) -> None:
        self.codes = torch.zeros(code_bytes + CODE_PAD, dtype=torch.uint8, device=device)
        self.scale = torch.empty(params, dtype=torch.float16, device=device)
        self.zero = torch.empty(params, dtype=torch.float16, device=device)
        self._code_end = self._param_end = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def add(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[int, int]:
        code_at, param_at = self._code_end, self._param_end
        self.codes[code_at:code_at + codes.numel()].copy_(codes.reshape(-1), non_blocking=True)
        self.scale[param_at:param_at + scale.numel()].copy_(scale.reshape(-1), non_blocking=True)
        self.zero[param_at:param_at + zero.numel()].copy_(zero.reshape(-1), non_blocking=True)
        self._code_end += codes.numel()
        self._param_end += scale.numel()
        return code_at, param_at
