"""hexq.devices.resolve_device: auto/cpu/cuda/cuda:N, with and without CUDA (torch.cuda monkeypatched)."""

import pytest
import torch

from hexq.devices import resolve_device
from hexq.errors import HexqError


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_cpu_only_machine(no_cuda):
    assert resolve_device(None) == resolve_device("auto") == resolve_device(" CPU ") == torch.device("cpu")
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(HexqError, match=f"--device {spec}: CUDA is not available on this machine; use "
                                            "--device cpu or auto"):
            resolve_device(spec)


def test_machine_with_two_gpus(two_gpus):
    assert resolve_device(None) == resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(HexqError, match="has 2 CUDA device\\(s\\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "mps", "cuda:", "cuda:-1", "cuda:x", "cuda0", "", "cpu:0"])
def test_unknown_spellings(two_gpus, spec):
    with pytest.raises(HexqError, match="use auto, cpu, cuda or cuda:N") as err:
        resolve_device(spec)
    assert "\n" not in str(err.value)


def test_this_machine():
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device(None) == expected
