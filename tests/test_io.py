import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hexq.base.errors import HexqError
from hexq.base.io import SAFETENSORS_DTYPES, SafetensorsWriter, safetensors_layout


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("dtype", list(SAFETENSORS_DTYPES), ids=lambda d: SAFETENSORS_DTYPES[d])
def test_every_dtype_round_trips_byte_for_byte(tmp_path, dtype):
    tensors = {"matrix": sample(dtype, (3, 5), 1), "scalar": sample(dtype, (), 2), "empty": sample(dtype, (0, 4), 3),
               "cube": sample(dtype, (2, 1, 3), 4)}
    path = tmp_path / "t.safetensors"
    with SafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}) as w:
        for name in ["cube", "scalar", "matrix", "empty"]:  # not the declared order
            w.write(name, tensors[name])
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert same_bytes(loaded[name], tensor), name
    with safe_open(path, "pt") as f:
        for name, tensor in tensors.items():
            assert same_bytes(f.get_tensor(name), tensor), name
    assert leftovers(tmp_path) == ["t.safetensors"]


def test_mixed_dtypes_match_safetensors_own_file_and_keep_metadata(tmp_path):
    tensors = {"w": sample(torch.bfloat16, (7, 3)), "bias": sample(torch.float32, (5,)),
               "ids": sample(torch.int64, (3,)), "mask": sample(torch.bool, (9,)), "h": sample(torch.float16, (1,))}
    metadata = {"format": "pt", "note": "x"}
    ours = tmp_path / "ours.safetensors"
    with SafetensorsWriter(ours, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, metadata=metadata) as w:
        for name, tensor in tensors.items():
            w.write(name, tensor)
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs, metadata=metadata)
    a, b = load_file(ours), load_file(theirs)
    for name in tensors:
        assert same_bytes(a[name], b[name]), name
    with safe_open(ours, "pt") as f:
        assert f.metadata() == metadata
    raw = ours.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    for name, info in header.items():
        if name != "__metadata__":  # every tensor starts aligned to its element size
            assert info["data_offsets"][0] % tensors[name].element_size() == 0, name
    assert len(raw) == 8 + n + sum(t.numel() * t.element_size() for t in tensors.values())


def test_non_contiguous_input_is_written_as_its_values(tmp_path):
    t = sample(torch.float32, (4, 6)).t()
    path = tmp_path / "t.safetensors"
    with SafetensorsWriter(path, {"t": (t.dtype, tuple(t.shape))}) as w:
        w.write("t", t)
    assert torch.equal(load_file(path)["t"], t)


def declare(tmp_path):
    path = tmp_path / "x.safetensors"
    return path, SafetensorsWriter(path, {"a": (torch.bfloat16, (2, 3)), "b": (torch.float32, (4,))})


@pytest.mark.parametrize("bad, pattern", [
    (("a", torch.zeros(3, 2, dtype=torch.bfloat16)), r"'a'.*shape \(3, 2\).*\(2, 3\)"),
    (("a", torch.zeros(2, 3, dtype=torch.float32)), r"'a'.*dtype torch.float32.*torch.bfloat16"),
    (("c", torch.zeros(1)), r"'c' was not declared"),
])
def test_wrong_tensor_raises_naming_it_and_leaves_nothing(tmp_path, bad, pattern):
    path, w = declare(tmp_path)
    with pytest.raises(HexqError, match=pattern):
        with w:
            w.write("b", torch.zeros(4))
            w.write(*bad)
    assert leftovers(tmp_path) == []


def test_wrong_tensor_without_a_with_block_also_removes_the_temporary_file(tmp_path):
    path, w = declare(tmp_path)
    with pytest.raises(HexqError, match="'b': shape"):
        w.write("b", torch.zeros(5))
    assert leftovers(tmp_path) == []
    with pytest.raises(HexqError, match="already closed"):
        w.write("a", torch.zeros(2, 3, dtype=torch.bfloat16))


def test_duplicate_write_raises(tmp_path):
    path, w = declare(tmp_path)
    with pytest.raises(HexqError, match="'b' written twice"):
        with w:
            w.write("b", torch.zeros(4))
            w.write("b", torch.zeros(4))
    assert leftovers(tmp_path) == []


def test_missing_tensor_raises_at_close_and_leaves_nothing(tmp_path):
    path, w = declare(tmp_path)
    with pytest.raises(HexqError, match="'a' declared but never written"):
        with w:
            w.write("b", torch.zeros(4))
    assert leftovers(tmp_path) == []


def test_exception_in_block_removes_the_temporary_file_and_keeps_an_old_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with SafetensorsWriter(path, {"b": (torch.float32, (4,))}):
            assert len(leftovers(tmp_path)) == 2  # the old file and the temporary one
            raise RuntimeError("boom")
    assert leftovers(tmp_path) == ["x.safetensors"]
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("specs, pattern", [
    ({"a": (torch.complex128, (2,))}, "no safetensors name"),
    ({"a": (torch.float32, (-1,))}, "negative"),
    ({"__metadata__": (torch.float32, (1,))}, "__metadata__"),
    ({"a": torch.float32}, r"\(torch.dtype, shape tuple\)"),
])
def test_bad_declarations_are_rejected(tmp_path, specs, pattern):
    with pytest.raises(HexqError, match=pattern):
        SafetensorsWriter(tmp_path / "x.safetensors", specs)
    assert leftovers(tmp_path) == []


def test_layout_packs_without_gaps_largest_elements_first():
    layout = safetensors_layout({"h": (torch.bfloat16, (3,)), "f": (torch.float32, (1,)), "d": (torch.float64, (2,)),
                                 "u": (torch.uint8, (5,))})
    assert [e.name for e in layout] == ["d", "f", "h", "u"]
    assert [(e.begin, e.end) for e in layout] == [(0, 16), (16, 20), (20, 26), (26, 31)]


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import os

    from hexq.base.io import write_bytes_atomic

    path = tmp_path / "manifest.json"
    write_bytes_atomic(path, b"old")

    def full_disk(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_bytes_atomic(path, b"new")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("text, size", [("4096", 4096), ("200MB", 200_000_000), ("12 kB", 12_000), ("1m", 10**6),
                                        ("512KiB", 524_288), ("1.5GiB", 1_610_612_736), ("64mib", 67_108_864),
                                        ("2 TB", 2 * 10**12), ("100b", 100)])
def test_sizes_read_as_people_write_them(text, size):
    """Decimal units are powers of 1000, binary ones of 1024 (SI / IEC), whatever the case."""
    from hexq.base.units import parse_bytes

    assert parse_bytes(text) == size


@pytest.mark.parametrize("text, message", [("ten", "cannot read"), ("5 parsecs", "cannot read"),
                                           ("-5MB", "cannot read"), ("0", "must be positive"),
                                           ("0.1b", "must be positive")])
def test_sizes_that_are_not_sizes_are_refused_in_one_line(text, message):
    from hexq.base.units import parse_bytes

    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


def test_sizes_print_in_binary_units():
    from hexq.base.units import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**40)] == [
        "0 B", "1023 B", "1.50 KiB", "3.00 MiB", "5120.00 GiB"]
