"""A check that code creates every tensor on an explicit device (the device of the data it joins)."""

from __future__ import annotations

import contextlib

import torch

FACTORIES = {torch.arange, torch.empty, torch.empty_strided, torch.eye, torch.full, torch.linspace, torch.logspace,
             torch.ones, torch.rand, torch.randint, torch.randn, torch.randperm, torch.tensor, torch.zeros}


class _ImplicitDevice(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.calls.append(func.__name__)
        return func(*args, **kwargs)


@contextlib.contextmanager
def default_device_meta_and_no_implicit_device():
    """Run with torch.set_default_device("meta") in effect (a tensor created without a device lands on meta and
    cannot silently join CPU data), and fail if any factory function is called without device=."""
    previous = torch.get_default_device()
    mode = _ImplicitDevice()
    torch.set_default_device("meta")
    try:
        with mode:
            yield
    finally:
        torch.set_default_device(previous)
    assert not mode.calls, f"tensors created without an explicit device: {sorted(set(mode.calls))}"
