"""Dense bit packing of integer codes for every width 1..8, and dequantization of packed codes into a float matrix.

Layout: codes are flattened (row-major) into one little-endian bit stream. Code i occupies stream bits
[i*bits, (i+1)*bits), least significant bit first, and stream bit j is bit (j % 8) of byte j // 8. The last byte is
zero-padded. So n codes of `bits` bits take exactly ceil(bits*n/8) bytes, with no per-row or per-byte padding
(3-bit codes cost 3 bits each, not 4). Shapes are not stored: the caller keeps numel (and the shape) alongside.

How unpacking works without per-code integer temporaries. Codes are unpacked into a uint8 buffer, one byte per code,
which is worked on through 16-, 32- or 64-bit integer views ("words") of that same buffer: a word of K bytes holds
the K codes of one whole-byte group (lcm(bits, 8) bits: 1 byte holds 8/bits codes at 1, 2 and 4 bits; 3, 5 and 7
bytes hold 8 codes; 3 bytes hold 4 codes at 6 bits). First each word receives its group's bits, packed at the
bottom (bits*i for code i): at 1, 2 and 4 bits a widening copy of the stream bytes; at 3, 5, 6 and 7 bits, where
groups straddle stream words, shifts and masks on a planar copy of the stream (see _unpack_into). Then log2(K)
shift-and-mask steps move code i to bit 8*i, halving the distance each time. Every step is a few whole-tensor ops,
however many codes there are. Packing runs the same steps backwards. Besides the code buffer, unpacking needs a
workspace of 1 to 1.9 times its size; `dequantize_into` takes it from the output matrix, which is written last.
"""

from __future__ import annotations

import functools
import math

import torch

_WORD_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # bytes per word -> integer dtype
_CHUNK = 64  # code buffers are rounded up to this many codes: a whole number of word chunks for every width
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for `numel` codes of `bits` bits: ceil(bits * numel / 8)."""
    _check_bits(bits)
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    return (bits * numel + 7) // 8


def code_buffer_nbytes(numel: int) -> int:
    """Bytes of the uint8 code buffer that unpacking `numel` codes needs: numel rounded up to a multiple of 64."""
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    return -(-numel // _CHUNK) * _CHUNK


def _group(bits: int) -> tuple[int, int]:
    """(bytes, codes) of the smallest whole-byte group: lcm(bits, 8) bits, e.g. 3 bytes hold 8 codes of 3 bits."""
    span = math.lcm(bits, 8)
    return span // 8, span // bits


def _signed(value: int, nbits: int) -> int:
    """An unsigned nbits-bit constant as the signed integer of the same bits (torch's integer dtypes are signed)."""
    return value - (1 << nbits) if value >> (nbits - 1) else value


@functools.cache
def _spread_steps(bits: int, lanes: int) -> tuple[tuple[int, int, int, int], ...]:
    """(c, shift, kept mask, moved mask) of each step taking `lanes` codes from bit bits*i to bit 8*i of a word.

    Step c (c = lanes/2, ..., 1) works on runs of 2c codes that start at bit 16c*k, codes packed `bits` apart: the
    upper c codes of each run move up by c*(8 - bits), to bit 8c of the run. Afterwards runs of c codes start at
    bit 8c*k, so the last step (c = 1) leaves code i at bit 8*i. Masks cover the codes' bits after the step.
    """
    steps = []
    c = lanes // 2
    while c:
        kept = moved = 0
        for i in range(lanes):
            field = ((1 << bits) - 1) << (8 * c * (i // c) + bits * (i % c))
            if (i // c) % 2:
                moved |= field
            else:
                kept |= field
        steps.append((c, c * (8 - bits), kept, moved))
        c //= 2
    return tuple(steps)


def _spread(words: torch.Tensor, bits: int, lanes: int, work: torch.Tensor) -> None:
    """Move the `lanes` codes of every word from bit bits*i to bit 8*i, in place. `work`: words-sized scratch."""
    nbits = 8 * words.element_size()
    for c, shift, kept, moved in _spread_steps(bits, lanes):
        if bits <= 2 and c <= 2:
            # At 1 and 2 bits a run and its shifted copy never overlap, so x | x << shift == x * (1 + 2^shift):
            # one multiply instead of a shift and an or. Runs of 2c <= 4 codes stay inside 32-bit halves, so this
            # is done on int32 views, whose multiply the CPU vectorizes (int64's it does not); products stay
            # below 2^26.
            halves = words.view(torch.int32)
            halves.mul_(1 + (1 << shift))
            halves.bitwise_and_(_signed((kept | moved) & 0xFFFFFFFF, 32))
            continue
        shifted = work[: words.numel()]
        torch.bitwise_left_shift(words, shift, out=shifted)
        if bits <= 4:  # the unshifted upper codes and the shifted lower ones fall outside the new positions
            words.bitwise_or_(shifted)
            words.bitwise_and_(_signed(kept | moved, nbits))
        else:
            shifted.bitwise_and_(_signed(moved, nbits))
            words.bitwise_and_(_signed(kept, nbits))
            words.bitwise_or_(shifted)


def _gather(words: torch.Tensor, bits: int, lanes: int, work: torch.Tensor) -> None:
    """Inverse of _spread: move code i of every word from bit 8*i to bit bits*i, in place."""
    nbits = 8 * words.element_size()
    for _, shift, kept, moved in reversed(_spread_steps(bits, lanes)):
        shifted = work[: words.numel()]
        torch.bitwise_and(words, _signed(moved, nbits), out=shifted)
        shifted.bitwise_right_shift_(shift)  # moved never holds bit 63: the arithmetic shift is a logical one
        words.bitwise_and_(_signed(kept, nbits))
        words.bitwise_or_(shifted)


def _columns(group_bytes: int, word_bytes: int) -> list[tuple[int, int, bool]]:
    """For the groups of `group_bytes` bytes read from a stream of `word_bytes`-byte words: a chunk of group_bytes
    stream words holds word_bytes groups; group j starts in stream word a at bit o, and `spans` into word a + 1."""
    cols = []
    for j in range(word_bytes):
        a, o = divmod(8 * group_bytes * j, 8 * word_bytes)
        cols.append((a, o, o + 8 * group_bytes > 8 * word_bytes))
    return cols


@functools.lru_cache(maxsize=32)
def _cut_plan(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[tuple]]:
    """How to cut the groups of a chunk out of its stream words, as tensors on `device` (made once per device):
    (first word [lanes], right shift [lanes, 1], spans), spans a list of (rows, next word [k], kept bits [k, 1],
    left shift [k, 1]) for the groups that reach into the next word, `rows` a slice over group positions."""
    group_bytes, lanes = _group(bits)
    dtype, width = _WORD_DTYPES[lanes], 8 * lanes
    columns = _columns(group_bytes, lanes)
    spanning = [j for j, (_, _, spans) in enumerate(columns) if spans]
    runs: list[list[int]] = []  # spanning positions as arithmetic runs, each one slice of the planes
    for j in spanning:
        if runs and (len(runs[-1]) == 1 or j - runs[-1][-1] == runs[-1][1] - runs[-1][0]):
            runs[-1].append(j)
        else:
            runs.append([j])

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)[:, None]

    spans = []
    for run in runs:
        step = run[1] - run[0] if len(run) > 1 else 1
        rows = slice(run[0], run[-1] + 1, step)
        spans.append((rows, index([columns[j][0] + 1 for j in run]),
                      column([_signed((1 << (width - columns[j][1])) - 1, width) for j in run]),
                      column([width - columns[j][1] for j in run])))
    return index([a for a, _, _ in columns]), column([o for _, o, _ in columns]), spans


def _transpose_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[i, j] = src[j, i] for 2-D tensors. Copied through 3-D views with a unit dimension: on CPU torch's 2-D
    transposed copy takes a path three times slower."""
    dst.unsqueeze(1).copy_(src.t().unsqueeze(1))


def _workspace_nbytes(numel: int, bits: int) -> int:
    """Bytes of workspace _unpack_into needs besides the code buffer (0 at 8 bits)."""
    group_bytes, lanes = _group(bits)
    if lanes == 1:
        return 0
    buffer = code_buffer_nbytes(numel)
    if group_bytes == 1:
        return buffer
    return buffer // lanes * (group_bytes + lanes)  # the stream words and the groups, both planar


def _carve(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of a contiguous tensor's memory, starting 8-byte aligned, or fresh ones if it is too small."""
    flat = tensor.reshape(-1).view(torch.uint8)
    skip = (-flat.storage_offset()) % 8
    if flat.numel() - skip >= nbytes:
        return flat[skip:skip + nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)


def _unpack_into(codes: torch.Tensor, packed: torch.Tensor, bits: int, numel: int, work: torch.Tensor) -> torch.Tensor:
    """Unpack `numel` codes into `codes` (uint8, >= code_buffer_nbytes(numel), 8-byte aligned); returns codes[:numel].

    `work` holds at least _workspace_nbytes(numel, bits) bytes, 8-byte aligned, and is overwritten.
    """
    group_bytes, lanes = _group(bits)
    if lanes == 1:
        codes[:numel].copy_(packed)
        return codes[:numel]
    if numel == 0:
        return codes[:0]
    dtype = _WORD_DTYPES[lanes]
    nbytes = packed.numel()
    if group_bytes == 1:  # 1, 2 and 4 bits: one stream byte per word, widened by the copy
        words = codes[: nbytes * lanes].view(dtype)
        words.copy_(packed)
    else:
        # 3, 5, 6 and 7 bits: a group straddles stream words. A chunk of group_bytes stream words holds `lanes`
        # groups; with chunks laid out planar (position in the chunk major), cutting group j out of stream words a
        # and a + 1 is contiguous work on whole planes; two transposing copies go in and out of that layout.
        chunks = code_buffer_nbytes(numel) // (lanes * lanes)
        stream = codes[: chunks * group_bytes * lanes]  # the code buffer is free until the groups are copied in
        stream[:nbytes].copy_(packed)  # also aligns the stream, which may sit at any byte offset of a file mapping
        stream[nbytes:].zero_()
        source = work[: stream.numel()].view(dtype).view(group_bytes, chunks)
        _transpose_into(source, stream.view(dtype).view(chunks, group_bytes))
        groups = work[stream.numel(): stream.numel() + chunks * lanes * lanes].view(dtype).view(lanes, chunks)
        first, right, spans = _cut_plan(bits, packed.device)
        # Group j = word a >> o, which is all of it unless it spans into word a + 1: then only the 8*lanes - o
        # bits that came from a are kept (the shift is an arithmetic one) and word a + 1 << (8*lanes - o) is or-ed
        # in. Each step is one op over a set of planes, with per-plane shifts and masks.
        torch.index_select(source, 0, first, out=groups)
        groups.bitwise_right_shift_(right)
        for rows, second, keep, left in spans:
            upper = codes[: second.numel() * chunks * lanes].view(dtype).view(-1, chunks)  # free: stream in `source`
            torch.index_select(source, 0, second, out=upper)
            groups[rows].bitwise_and_(keep)
            groups[rows].bitwise_or_(upper.bitwise_left_shift_(left))
        if bits <= 4:
            groups.bitwise_and_(_signed((1 << (8 * group_bytes)) - 1, 8 * lanes))
        words = codes[: chunks * lanes * lanes].view(dtype)
        _transpose_into(words.view(chunks, lanes), groups)
    _spread(words, bits, lanes, work.view(dtype))
    return codes[:numel]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any shape, values in [0, 2^bits - 1]) into a 1-D uint8 tensor of packed_nbytes bytes."""
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor (uint8), got dtype {codes.dtype}")
    flat = codes.reshape(-1)
    numel = flat.numel()
    if numel:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi > 2**bits - 1:
            raise ValueError(f"codes must lie in [0, {2**bits - 1}] for {bits} bits, got values in [{lo}, {hi}]")
    group_bytes, lanes = _group(bits)
    if lanes == 1:
        return flat.to(torch.uint8).contiguous().clone()
    buffer = torch.zeros(code_buffer_nbytes(numel), dtype=torch.uint8, device=flat.device)
    buffer[:numel].copy_(flat)
    dtype = _WORD_DTYPES[lanes]
    nbytes = packed_nbytes(numel, bits)
    words = buffer.view(dtype)
    _gather(words, bits, lanes, torch.empty_like(words))
    if group_bytes == 1:  # each word's group now sits in its low byte
        return words[:nbytes].to(torch.uint8)
    # The inverse of _unpack_into's planar cut: group j goes to bit o of stream word a (and a + 1 if it spans).
    chunks = buffer.numel() // (lanes * lanes)
    groups = torch.empty(lanes, chunks, dtype=dtype, device=flat.device)
    _transpose_into(groups, words.view(chunks, lanes))
    target = torch.zeros(group_bytes, chunks, dtype=dtype, device=flat.device)
    upper = torch.empty(chunks, dtype=dtype, device=flat.device)
    for j, (a, o, spans) in enumerate(_columns(group_bytes, lanes)):
        if spans:  # groups are non-negative after the gather: this right shift is a logical one
            torch.bitwise_right_shift(groups[j], 8 * lanes - o, out=upper)
            target[a + 1].bitwise_or_(upper)
        target[a].bitwise_or_(groups[j].bitwise_left_shift_(o))
    stream = buffer[: chunks * group_bytes * lanes]
    _transpose_into(stream.view(dtype).view(chunks, group_bytes), target)
    return stream[:nbytes].clone()


def _check_packed(packed: torch.Tensor, bits: int, numel: int) -> None:
    expected = packed_nbytes(numel, bits)
    if packed.dtype != torch.uint8 or packed.ndim != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got dtype {packed.dtype} and shape {tuple(packed.shape)}")
    if packed.numel() != expected:
        raise ValueError(f"packed buffer has {packed.numel()} bytes, expected {expected} for {numel} codes of "
                         f"{bits} bits")


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` codes as a 1-D uint8 tensor (reshape to the stored shape)."""
    _check_packed(packed, bits, numel)
    if bits == 8:
        return packed.clone()
    codes = torch.empty(code_buffer_nbytes(numel), dtype=torch.uint8, device=packed.device)
    work = torch.empty(_workspace_nbytes(numel, bits), dtype=torch.uint8, device=packed.device)
    return _unpack_into(codes, packed, bits, numel, work)


# ------------------------------------------------------------------------------------------ dequantization


class DequantScratch:
    """The reusable uint8 code buffer of `dequantize_into`: one byte per code, for matrices of up to `numel` codes.

    The caller owns it (one per thread: calls that share one must not overlap), sizes it once for the largest matrix
    it will dequantize, and reserves `nbytes` in its memory budget. It never grows: a larger matrix is a ValueError.
    """

    def __init__(self, numel: int, device: torch.device | str) -> None:
        self.buffer = torch.empty(code_buffer_nbytes(numel), dtype=torch.uint8, device=device)

    @classmethod
    def for_shapes(cls, shapes: list[tuple[int, int]], device: torch.device | str) -> DequantScratch:
        """A scratch large enough for every [rows, cols] in `shapes`."""
        return cls(max((rows * cols for rows, cols in shapes), default=0), device)

    @staticmethod
    def nbytes_for(numel: int) -> int:
        """Bytes a scratch for matrices of up to `numel` codes takes, without allocating it."""
        return code_buffer_nbytes(numel)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def codes(self, numel: int, device: torch.device) -> torch.Tensor:
        """The code buffer for a matrix of `numel` codes on `device`."""
        if device != self.device:
            raise ValueError(f"DequantScratch is on {self.device}, the packed codes on {device}; make it with "
                             f"device={str(device)!r}")
        needed = code_buffer_nbytes(numel)
        if needed > self.nbytes:
            raise ValueError(f"DequantScratch holds {self.nbytes} bytes, a matrix of {numel} codes needs {needed}; "
                             f"size it for the largest matrix (DequantScratch.for_shapes)")
        return self.buffer[:needed]


def _check_dequant_args(out: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                        group_size: int) -> None:
    _check_bits(bits)
    if out.dtype not in OUT_DTYPES:
        raise ValueError(f"out must be bfloat16, float16 or float32, got dtype {out.dtype}")
    if out.ndim != 2 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [rows, cols] tensor, got shape {tuple(out.shape)} "
                         f"(contiguous: {out.is_contiguous()})")
    rows, cols = out.shape
    if not isinstance(group_size, int) or group_size < 1 or cols % group_size:
        raise ValueError(f"group_size must be a positive divisor of the {cols} columns, got {group_size!r}")
    _check_packed(packed, bits, rows * cols)
    groups = (rows, cols // group_size)
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype not in PARAM_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got dtype {t.dtype}")
        if tuple(t.shape) != groups:
            raise ValueError(f"{name} must have shape [rows, cols // group_size] = {list(groups)}, got "
                             f"{list(t.shape)}")
    for name, t in (("out", out), ("scale", scale), ("zero", zero)):
        if t.device != packed.device:
            raise ValueError(f"{name} is on {t.device} but the packed codes are on {packed.device}; put them on one "
                             f"device")


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int, scratch: DequantScratch | None = None) -> torch.Tensor:
    """W = (q - zero) * scale written into `out` [rows, cols] (bfloat16, float16 or float32), q the codes `packed`
    holds (pack_bits of rows*cols codes, row-major), scale and zero [rows, cols // group_size]; returns out.

    float32: exactly the float32 reference hexq.algos.quant.dequantize (same operations, same order). bfloat16 and
    float16: the affine is computed in float32 and rounded once into out. With float16 (or bfloat16) scale and zero
    and zero = 0 or |zero| >= 2^-6 - every artifact hexq packs - that float32 value is the reference's, so out is
    bit for bit the reference converted to out's dtype; otherwise the two differ by float32 rounding first.

    Memory: the codes are unpacked into `scratch` (a DequantScratch; None allocates one for this call); the unpack
    workspace is out's own memory, written over before the result; besides, only per-group float32 copies of scale
    and zero (and a vector of ones) are allocated. Runs on the device of `packed`; all arguments must be on it.
    """
    _check_dequant_args(out, packed, bits, scale, zero, group_size)
    rows, cols = out.shape
    numel = rows * cols
    if numel == 0:
        return out
    if bits == 8:
        codes = packed
    else:
        if scratch is None:
            scratch = DequantScratch(numel, packed.device)
        buffer = scratch.codes(numel, packed.device)
        codes = _unpack_into(buffer, packed, bits, numel, _carve(out, _workspace_nbytes(numel, bits)))
    _affine_into(out, codes.view(rows, cols), scale, zero, group_size)
    return out


def _affine_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int) -> None:
    """out = (codes - zero) * scale per group of `group_size` columns (hexq.algos.quant.dequantize), in place."""
    rows, cols = out.shape
    groups = cols // group_size
    scale32, zero32 = scale.to(torch.float32), zero.to(torch.float32)
    if out.dtype == torch.float32:
        out.copy_(codes)  # codes are integers below 256: exact in every float dtype
        grouped = out.view(rows, groups, group_size)
        grouped.sub_(zero32[..., None])
        grouped.mul_(scale32[..., None])
    elif out.device.type == "cpu":
        _half_affine_batch_norm(out, codes, scale32, zero32, groups)
    else:
        _half_affine_rows(out, codes, scale32, zero32, groups)


def _half_affine_batch_norm(out: torch.Tensor, codes: torch.Tensor, scale32: torch.Tensor, zero32: torch.Tensor,
                            groups: int) -> None:
    """The bfloat16 / float16 affine on CPU, in one pass.

    A mixed-dtype elementwise op on CPU would first copy the whole matrix to float32. Inference batch norm is the one
    kernel that applies a per-channel affine with float32 parameters to a half-precision tensor in one pass, computing
    in float32 and rounding once: with every group a channel, running mean = zero, running var = 1, eps = 0, weight =
    scale, it computes q*scale - zero*scale. With half-precision scale and zero both products are exact in float32 (8
    or 11 bits times 11 bits), so that is (q - zero) * scale rounded once to float32: the reference's value whenever
    its q - zero is exact, i.e. zero = 0 or |zero| >= 2^-6.

    CPU only: torch's CUDA batch norm writes the running mean into `save_mean` and then 1/sqrt(var + eps) into
    `save_invstd` before it computes, so the two must be distinct tensors (one shared buffer turned every mean
    into 1.0 on CUDA: (q - 1) * scale, the wrong weights behind `hexq run --device cuda`'s perplexity of ~10^4), and
    its behaviour there is not this module's to rely on."""
    rows, cols = out.shape
    out.copy_(codes)
    channels = out.view(1, rows * groups, cols // groups)
    ones = torch.ones(rows * groups, dtype=torch.float32, device=out.device)
    save_mean = torch.empty(0, dtype=torch.float32, device=out.device)
    save_invstd = torch.empty(0, dtype=torch.float32, device=out.device)
    torch.ops.aten.native_batch_norm.out(channels, scale32.reshape(-1), None, zero32.reshape(-1), ones, False, 0.0,
                                         0.0, out=channels, save_mean=save_mean, save_invstd=save_invstd)


# Rows of a half-precision matrix computed through one float32 block on accelerators: bounds the transient block to
# ROW_BLOCK_ELEMENTS * 4 bytes whatever the matrix.
ROW_BLOCK_ELEMENTS = 1 << 22


def _half_affine_rows(out: torch.Tensor, codes: torch.Tensor, scale32: torch.Tensor, zero32: torch.Tensor,
                      groups: int) -> None:
    """The bfloat16 / float16 affine with plain elementwise ops, a block of rows at a time: (q - zero) * scale in
    float32, rounded once into out (the same value as the reference converted, as on CPU)."""
    rows, cols = out.shape
    step = max(1, ROW_BLOCK_ELEMENTS // cols)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        block = codes[start:end].view(end - start, groups, cols // groups).to(torch.float32)
        block.sub_(zero32[start:end, :, None]).mul_(scale32[start:end, :, None])
        out[start:end].copy_(block.view(end - start, cols))
