"""GPU kernels on packed weights (Triton): a GEMV over (token, expert) pairs that reads each pair's matrix from one
arena of packed codes, whatever its width, so that a layer's routed experts take one launch per projection.

The pair GEMV. y[p, r] = sum_c W_p[r, c] x[p, c] for every pair p, W_p = (q - zero) * scale per group of GROUP codes,
q the `bits_p`-bit codes of one little-endian bit stream (hexq.packed.bitpack) that starts at byte code_offset[p] of
the codes arena; its float16 scale and zero start at element param_offset[p] of their arenas. Code i of a matrix
sits at stream bit i * bits: two byte loads and a shift give it for any width 1-8 (the arena is padded so that the
second load stays inside). The tables are device tensors indexed by the routing itself (experts chosen by the router
on the device), so a decode step has no host synchronisation and one launch covers every expert of a layer at mixed
widths. The same kernel computes a quantized dense linear: every row of x is a pair on the same matrix.

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


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _pair_gemv(x_ptr, y_ptr, codes_ptr, scale_ptr, zero_ptr, code_off_ptr, param_off_ptr, bits_ptr,
                   rows, cols, x_stride, y_stride, table_stride,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        row = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row < rows
        entry = pair * table_stride  # 0: every pair reads the same matrix (a dense linear)
        bits = tl.load(bits_ptr + entry).to(tl.int64)
        code_off = tl.load(code_off_ptr + entry)
        param_off = tl.load(param_off_ptr + entry)
        mask = (1 << bits) - 1
        groups = cols // GROUP
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, cols, BLOCK_K):
            col = start + tl.arange(0, BLOCK_K)
            col_ok = col < cols
            x = tl.load(x_ptr + pair * x_stride + col, mask=col_ok, other=0.0).to(tl.float32)
            ok = row_ok[:, None] & col_ok[None, :]
            bit = (row[:, None].to(tl.int64) * cols + col[None, :]) * bits
            byte = code_off + (bit >> 3)
            low = tl.load(codes_ptr + byte, mask=ok, other=0).to(tl.int64)
            high = tl.load(codes_ptr + byte + 1, mask=ok, other=0).to(tl.int64)
            q = ((low | (high << 8)) >> (bit & 7)) & mask
            param = param_off + row[:, None].to(tl.int64) * groups + col[None, :] // GROUP
            scale = tl.load(scale_ptr + param, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + param, mask=ok, other=0.0).to(tl.float32)
            acc += tl.sum((q.to(tl.float32) - zero) * scale * x[None, :], axis=1)
        tl.store(y_ptr + pair * y_stride + row, acc, mask=row_ok)


def pair_gemv(x: torch.Tensor, arena: PackedArena, code_offset: torch.Tensor, param_offset: torch.Tensor,
              bits: torch.Tensor, shape: tuple[int, int], group: int) -> torch.Tensor:
    """y [P, rows] float32 for x [P, cols]: pair p through the matrix the tables' entry p points at (tables of one
    entry: every pair through that one matrix)."""
    rows, cols = shape
    pairs = x.shape[0]
    y = torch.empty(pairs, rows, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return y
    x = x.contiguous()
    stride = 0 if code_offset.numel() == 1 else 1
    grid = (pairs, triton.cdiv(rows, BLOCK_N))
    _pair_gemv[grid](x, y, arena.codes, arena.scale, arena.zero, code_offset, param_offset, bits, rows, cols,
                     x.stride(0), y.stride(0), stride, GROUP=group, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
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
