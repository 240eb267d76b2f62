"""GGML's quantized block formats (llama.cpp's GGUF tensors): encoded from integer codes and their block parameters,
decoded to float, and hexq's stored codes written in them.

Layouts (ggml/src/ggml-common.h; a tensor row [cols] is cols / block_size blocks, little-endian, no padding):
- Q8_0, 32 weights, 34 bytes: float16 d, int8 q[32];                         x = d q
- Q4_0, 32 weights, 18 bytes: float16 d, nibbles qs[16];                       x = d (q - 8)
- Q4_1, 32 weights, 20 bytes: float16 d, float16 m, nibbles qs[16];            x = d q + m
  (nibbles: weight j in the low nibble of qs[j], weight j + 16 in the high nibble, j < 16)
- Q2_K, 256 weights, 84 bytes: scales[16] (sub-block scale sc in the low nibble, min m in the high nibble),
  qs[64] (2-bit codes), float16 d, float16 dmin;   x = d sc_j q - dmin m_j for weight e in sub-block j = e // 16
- Q3_K, 256 weights, 110 bytes: hmask[32] (code bit 2), qs[64] (code bits 0-1), scales[12] (16 6-bit scales,
  stored + 32), float16 d;                         x = d sc_j (u - 4), u in 0..7 the 3-bit code
  In both K-quants weight e's two low code bits sit in qs[32 (e // 128) + e % 32] at bit 2 ((e % 128) // 32);
  Q3_K's high bit in hmask[e % 32] at bit e // 32; scale j's low 4 bits in the low (j < 8) or high nibble of byte
  j % 8, its high 2 bits in byte 8 + j % 4 at bit 2 (j // 4).

Every encoder takes codes [rows, cols] (uint8, on the type's own code range) and the per-block parameters, every
decoder returns float32 [rows, cols]; both are whole-tensor ops (no per-block Python loop), and row-wise, so a stack
of experts' matrices is one call on their rows.

hexq's stored matrix (hexq.packed.weight.PackedWeight: w = (q - zero) * scale per group of input columns, scale and
zero float16) over 32-weight blocks (a group of 32k columns is k blocks with the same parameters; a per-channel grid
repeats over the whole row), `packed_blocks`:
- Q4_1: d = scale, m = -zero * scale (computed in float32, rounded once to float16: the only rounding), q unchanged;
- Q4_0 and Q8_0 (symmetric grids, zero = 2^(b-1)): signed code q - 2^(b-1) with d = scale, exactly; 1-bit
  symmetric (zero 0.5) as 2q - 1 with d = scale / 2;
- Q8_0 of an asymmetric code: re-rounded (`rtn_q8_0`; Q8_0 has no zero point).
K-quant codes are made on their own grid (hexq.algos.kquant) and stored as their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hexq.packed.bitpack import unpack_bits
from hexq.packed.weight import PackedWeight, dequantize_packed


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml: int  # GGMLQuantizationType
    block: int  # weights per block
    nbytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        if cols % self.block:
            raise ValueError(f"{self.name} needs rows that are a multiple of {self.block} weights, got {cols}")
        return cols // self.block * self.nbytes


Q8_0 = BlockType("Q8_0", 8, 32, 34)
Q4_0 = BlockType("Q4_0", 2, 32, 18)
Q4_1 = BlockType("Q4_1", 3, 32, 20)
Q2_K = BlockType("Q2_K", 10, 256, 84)
Q3_K = BlockType("Q3_K", 11, 256, 110)
BLOCK_TYPES = {t.name: t for t in (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K)}
SUB = 16  # weights per K-quant sub-block


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """float16 values [..., n] as their little-endian bytes [..., 2n]."""
    flat = values.to(torch.float16).reshape(-1)  # 1-D: strides of size-1 dims cannot get in the way of the view
    return flat.view(torch.uint8).reshape(*values.shape[:-1], 2 * values.shape[-1])


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 bytes [..., 2] as float32 [...]."""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def _blocks(codes: torch.Tensor, size: int) -> torch.Tensor:
    rows, cols = codes.shape
    if cols % size:
        raise ValueError(f"rows of {cols} weights are not a whole number of {size}-weight blocks")
    return codes.reshape(rows, cols // size, size)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [rows, blocks, 32] (0..15) as qs [rows, blocks, 16]: weight j low nibble, weight j + 16 high."""
    return q[..., :16] | (q[..., 16:] << 4)


def _unnibble(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 15, qs >> 4], dim=-1)


# ------------------------------------------------------------------------------------------ 32-weight blocks


def encode_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 [rows, cols], d [rows, cols / 32] -> Q8_0 bytes [rows, cols / 32 * 34]."""
    blocks = _blocks(q.to(torch.int8), 32).view(torch.uint8)
    return torch.cat([_half_bytes(d).reshape(*blocks.shape[:2], 2), blocks], -1).reshape(q.shape[0], -1)


def decode_q8_0(raw: torch.Tensor, cols: int) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], cols // 32, 34)
    return (blocks[..., 2:].contiguous().view(torch.int8).float() * _half(blocks[..., :2])[..., None]).reshape(-1,
                                                                                                          cols)


def encode_q4_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q uint8 [rows, cols] in 0..15 (x = d (q - 8)), d [rows, cols / 32] -> Q4_0 bytes."""
    blocks = _blocks(q.to(torch.uint8), 32)
    return torch.cat([_half_bytes(d).reshape(*blocks.shape[:2], 2), _nibbles(blocks)], -1).reshape(q.shape[0], -1)


def decode_q4_0(raw: torch.Tensor, cols: int) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], cols // 32, 18)
    q = _unnibble(blocks[..., 2:]).float() - 8
    return (q * _half(blocks[..., :2])[..., None]).reshape(-1, cols)


def encode_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q uint8 [rows, cols] in 0..15 (x = d q + m), d and m [rows, cols / 32] -> Q4_1 bytes."""
    blocks = _blocks(q.to(torch.uint8), 32)
    head = torch.stack([d.to(torch.float16), m.to(torch.float16)], -1).contiguous().view(torch.uint8)
    return torch.cat([head.reshape(*blocks.shape[:2], 4), _nibbles(blocks)], -1).reshape(q.shape[0], -1)


def decode_q4_1(raw: torch.Tensor, cols: int) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], cols // 32, 20)
    d, m = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    return (_unnibble(blocks[..., 4:]).float() * d[..., None] + m[..., None]).reshape(-1, cols)


# ------------------------------------------------------------------------------------------ K-quants


def _pack_low2(q: torch.Tensor) -> torch.Tensor:
    """Codes [rows, sb, 256] -> qs [rows, sb, 64]: bits 0-1 of weight e at byte 32 (e // 128) + e % 32, bit
    2 ((e % 128) // 32)."""
    rows, sb, _ = q.shape
    parts = (q & 3).reshape(rows, sb, 2, 4, 32)
    packed = parts[:, :, :, 0] | (parts[:, :, :, 1] << 2) | (parts[:, :, :, 2] << 4) | (parts[:, :, :, 3] << 6)
    return packed.reshape(rows, sb, 64)


def _unpack_low2(qs: torch.Tensor) -> torch.Tensor:
    rows, sb, _ = qs.shape
    halves = qs.reshape(rows, sb, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).reshape(1, 1, 1, 4, 1)
    return ((halves >> shifts) & 3).reshape(rows, sb, 256)


def encode_q2_k(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
                dmin: torch.Tensor) -> torch.Tensor:
    """q uint8 [rows, cols] in 0..3, sc and m [rows, cols / 16] in 0..15, d and dmin [rows, cols / 256]
    -> Q2_K bytes (x = d sc q - dmin m)."""
    blocks = _blocks(q.to(torch.uint8), 256)
    rows, sb, _ = blocks.shape
    scales = (sc.to(torch.uint8) | (m.to(torch.uint8) << 4)).reshape(rows, sb, 16)
    tail = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], -1).contiguous().view(torch.uint8)
    return torch.cat([scales, _pack_low2(blocks), tail.reshape(rows, sb, 4)], -1).reshape(rows, -1)


def decode_q2_k(raw: torch.Tensor, cols: int) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], cols // 256, 84)
    rows, sb, _ = blocks.shape
    scales = blocks[..., :16]
    q = _unpack_low2(blocks[..., 16:80]).float().reshape(rows, sb, 16, SUB)
    d, dmin = _half(blocks[..., 80:82]), _half(blocks[..., 82:84])
    step = (d[..., None] * (scales & 15).float())[..., None]
    low = (dmin[..., None] * (scales >> 4).float())[..., None]
    return (step * q - low).reshape(rows, cols)


def _pack_scales6(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 6-bit scales [rows, sb, 16] -> Q3_K's 12 bytes."""
    low = (v[..., :8] & 15) | ((v[..., 8:] & 15) << 4)
    high = (v >> 4).reshape(*v.shape[:-1], 4, 4)  # [g, k]: scale k + 4 g
    high = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return torch.cat([low, high], -1)


def _unpack_scales6(raw: torch.Tensor) -> torch.Tensor:
    low = torch.cat([raw[..., :8] & 15, raw[..., :8] >> 4], -1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).reshape(4, 1)
    high = ((raw[..., None, 8:12] >> shifts) & 3).reshape(*raw.shape[:-1], 16)
    return low | (high << 4)


def encode_q3_k(u: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """u uint8 [rows, cols] in 0..7, sc [rows, cols / 16] in -32..31, d [rows, cols / 256] -> Q3_K bytes
    (x = d sc (u - 4))."""
    blocks = _blocks(u.to(torch.uint8), 256)
    rows, sb, _ = blocks.shape
    high = (blocks >> 2).reshape(rows, sb, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=u.device).reshape(1, 1, 8, 1)
    hmask = (high << shifts).sum(dim=2, dtype=torch.uint8)  # disjoint bits: the sum is their or
    scales = _pack_scales6((sc.to(torch.int16) + 32).to(torch.uint8).reshape(rows, sb, 16))
    return torch.cat([hmask, _pack_low2(blocks), scales, _half_bytes(d).reshape(rows, sb, 2)], -1).reshape(rows, -1)


def decode_q3_k(raw: torch.Tensor, cols: int) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], cols // 256, 110)
    rows, sb, _ = blocks.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device).reshape(1, 1, 8, 1)
    high = ((blocks[..., None, :32] >> shifts) & 1).reshape(rows, sb, 256)
    u = _unpack_low2(blocks[..., 32:96]) | (high << 2)
    sc = _unpack_scales6(blocks[..., 96:108]).float() - 32
    d = _half(blocks[..., 108:110])
    return ((d[..., None] * sc)[..., None] * (u.float() - 4).reshape(rows, sb, 16, SUB)).reshape(rows, cols)


DECODERS = {"Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q2_K": decode_q2_k, "Q3_K": decode_q3_k}


def decode(kind: BlockType, raw: torch.Tensor, cols: int) -> torch.Tensor:
    """Float32 [rows, cols] of blocks raw [rows, row_bytes] of `kind`."""
    return DECODERS[kind.name](raw, cols)


def rtn_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest Q8_0 of a float matrix [rows, cols] (per block d = max|w| / 127): the form of a weight no
    GGUF type holds exactly (hexq.export.gguf.plan says which)."""
    blocks = _blocks(w.float(), 32)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16).float()
    q = torch.where(d[..., None] > 0, blocks / d[..., None].clamp(min=1e-30), 0).round().clamp(-127, 127)
    return encode_q8_0(q.reshape(w.shape).to(torch.int8), d)


# ------------------------------------------------------------------------------------------ hexq's stored codes


def _block_params(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """scale and zero [rows, cols / 32] (float32) of a stored matrix: each group's over its blocks."""
    rows, cols = weight.shape
    per_group = cols // weight.scale.shape[1]
    if per_group % 32:
        raise ValueError(f"groups of {per_group} columns do not cover whole 32-weight blocks")
    repeat = per_group // 32
    return weight.scale.float().repeat_interleave(repeat, 1), weight.zero.float().repeat_interleave(repeat, 1)


def packed_blocks(weight: PackedWeight, symmetric: bool, kind: BlockType) -> torch.Tensor:
    """Blocks [rows, row_bytes] of `kind` holding a stored matrix (the forms of the module docstring)."""
    rows, cols = weight.shape
    if kind == Q8_0 and not symmetric:
        return rtn_q8_0(dequantize_packed(weight))
    q = unpack_bits(weight.codes, weight.bits, rows * cols).reshape(rows, cols)
    scale, zero = _block_params(weight)
    if kind == Q4_1:
        if weight.bits > 4:
            raise ValueError(f"a {weight.bits}-bit code does not fit Q4_1")
        return encode_q4_1(q, scale, -zero * scale)
    if not symmetric or kind not in (Q4_0, Q8_0):
        raise ValueError(f"{kind.name} does not hold a {'symmetric' if symmetric else 'asymmetric'} code exactly")
    if weight.bits == 1:
        signed, d = 2 * q.to(torch.int16) - 1, scale / 2
    else:
        signed, d = q.to(torch.int16) - 2 ** (weight.bits - 1), scale
    if kind == Q4_0:
        if weight.bits > 4:
            raise ValueError(f"a {weight.bits}-bit code does not fit Q4_0")
        return encode_q4_0((signed + 8).to(torch.uint8), d)
    return encode_q8_0(signed.to(torch.int8), d)
