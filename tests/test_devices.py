"""hexq.base.devices.resolve_device: auto/cpu/cuda/cuda:N, with and without CUDA (torch.cuda monkeypatched)."""

from pathlib import Path

import pytest
import torch

from hexq.base.devices import resolve_device
from hexq.base.errors import HexqError


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


def test_out_of_memory_is_one_line_naming_device_and_need():
    from hexq.base.devices import out_of_memory_message

    torch_text = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                  "1.10 GiB is free. Including non-PyTorch memory, this process has 78.0 GiB memory in use. Of the "
                  "allocated memory 76.9 GiB is allocated by PyTorch ...")
    message = out_of_memory_message(torch.OutOfMemoryError(torch_text), "calibrate")
    assert "\n" not in message and message.startswith("out of memory on cuda:0")
    assert "2.50 GiB" in message and "resumes" in message
    assert "--memory" in out_of_memory_message(torch.OutOfMemoryError("no details"), "run")


def test_cli_turns_out_of_memory_into_one_line(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from hexq.calib import pipeline
    from hexq_cli.main import app

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(pipeline, "calibrate", exhausted)
    model = Path(__file__).resolve().parent.parent / "models" / "hexq-tiny-qwen3moe"
    result = CliRunner().invoke(app, ["calibrate", str(model), "--out", str(tmp_path / "cal")])
    assert result.exit_code == 1 and "out of memory on cuda:0" in result.output
    assert "Traceback" not in result.output
