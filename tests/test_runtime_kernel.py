"""The miss path: the compiled dequantization kernel against bitpack.dequantize_into, the pread reader against
safetensors, and the fallback when the kernel does not cover an input."""

import pytest
import torch

from hexq.algos.quant import QuantSpec, quantize
from hexq.artifact.reader import Artifact, spans_buffer_nbytes
from hexq.packed.bitpack import dequantize_into, pack_bits
from hexq.packed.kernel import dequantize_packed_fast, load_kernel
from hexq.packed.weight import PackedWeight

KERNEL = load_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX-512 VBMI on this machine: the "
                                                         "kernel is not built and misses use the torch path")


def packed_weight(shape, bits, group, symmetric, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(shape, generator=generator) * 3
    codes, meta = quantize(w, QuantSpec(bits=bits, group_size=group, symmetric=symmetric))
    return PackedWeight(pack_bits(codes.to(torch.uint8), bits), meta.scale.half(), meta.zero.half(), bits, shape)


def reference(weight, dtype):
    out = torch.empty(weight.shape, dtype=dtype, device="cpu")
    rows, cols = weight.shape
    return dequantize_into(out, weight.codes, weight.bits, weight.scale, weight.zero, cols // weight.scale.shape[1])


def same_bits(a, b):
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.view(view), b.view(view))


@needs_kernel
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,group,symmetric", [((96, 64), 32, False), ((64, 48), 16, True), ((32, 128), 64, False)])
def test_kernel_is_bit_identical_to_dequantize_into(bits, dtype, shape, group, symmetric):
    weight = packed_weight(shape, bits, group, symmetric, seed=bits)
    out = torch.full(shape, float("nan"), dtype=dtype, device="cpu")
    assert KERNEL.supports(out, weight)
    assert same_bits(KERNEL(out, weight), reference(weight, dtype))


def test_inputs_the_kernel_does_not_cover_take_the_torch_path():
    weight = packed_weight((16, 24), 3, 8, False)  # groups of 8 codes, 384 codes: not the kernel's
    out = torch.empty(16, 24, dtype=torch.bfloat16, device="cpu")
    if KERNEL is not None:
        assert not KERNEL.supports(out, weight)
    assert same_bits(dequantize_packed_fast(out, weight, KERNEL), reference(weight, torch.bfloat16))
    wide = packed_weight((32, 64), 4, 32, False)
    as_float = PackedWeight(wide.codes, wide.scale.float(), wide.zero.float(), 4, (32, 64))  # float32 scales
    out = torch.empty(32, 64, dtype=torch.float32, device="cpu")
    if KERNEL is not None:
        assert not KERNEL.supports(out, as_float)
    expected = torch.empty_like(out)
    dequantize_into(expected, wide.codes, 4, as_float.scale, as_float.zero, 32)
    assert same_bits(dequantize_packed_fast(out, as_float, KERNEL), expected)


def test_read_expert_reads_the_stored_replicas(mixed_artifact):
    """pread of every stored replica gives the tensors safetensors gives, and counts the bytes."""
    artifact = Artifact(mixed_artifact)
    buffer = torch.empty(1 << 16, dtype=torch.uint8, device="cpu")
    expected_bytes = 0
    for row in range(len(artifact.moe_layers)):
        for expert in range(artifact.num_experts):
            for bits in artifact.stored_bits(row, expert):
                spans = artifact.expert_spans(row, expert, bits)
                assert spans_buffer_nbytes(spans) <= buffer.numel()
                expected_bytes += sum(s.end - s.start for s in spans)
                got = artifact.read_expert(row, expert, bits, buffer)
                for projection, weight in zip(("gate_up", "down"), got, strict=True):
                    want = artifact.packed_expert(row, expert, bits, projection)
                    assert weight.shape == want.shape and weight.bits == bits
                    for a, b in ((weight.codes, want.codes), (weight.scale, want.scale), (weight.zero, want.zero)):
                        assert a.dtype == b.dtype and torch.equal(a, b)
    assert artifact.bytes_read == expected_bytes
    with pytest.raises(ValueError, match="too small"):
        artifact.read_expert(0, 0, artifact.stored_bits(0, 0)[0], buffer[:8])
    artifact.close()
