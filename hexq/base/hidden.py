"""Activations at one layer boundary: every batch of the calibration or evaluation windows, in memory up to a byte
limit and spilled to files beyond it, so a streamed pass holds what fits and no more (hexq.model.streaming runs the
windows through one layer at a time)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch


class HiddenStore:
    """Per-batch activations of one layer boundary: in memory until `limit_bytes`, then one file per batch in a
    private spill folder (deleted by `close`). Indexing returns the tensor (read back from disk when spilled)."""

    def __init__(self, limit_bytes: int | None = None, spill_dir: Path | None = None) -> None:
        self.limit = limit_bytes
        self.parent = spill_dir
        self._items: list[torch.Tensor | Path] = []
        self._memory = 0
        self._folder: Path | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def memory_bytes(self) -> int:
        return self._memory

    @property
    def spilled(self) -> int:
        return sum(isinstance(item, Path) for item in self._items)

    def _spill_path(self, index: int) -> Path:
        if self._folder is None:
            if self.parent is not None:
                self.parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix=".hexq-activations-", dir=self.parent))
        return self._folder / f"{index:06d}.pt"

    def append(self, tensor: torch.Tensor) -> None:
        self._items.append(self._keep(len(self._items), tensor))

    def __setitem__(self, index: int, tensor: torch.Tensor) -> None:
        old = self._items[index]
        if isinstance(old, torch.Tensor):
            self._memory -= old.numel() * old.element_size()
        self._items[index] = self._keep(index, tensor)

    def _keep(self, index: int, tensor: torch.Tensor) -> torch.Tensor | Path:
        nbytes = tensor.numel() * tensor.element_size()
        if self.limit is None or self._memory + nbytes <= self.limit:
            self._memory += nbytes
            return tensor
        path = self._spill_path(index)
        torch.save(tensor.detach().cpu(), path)
        return path

    def __getitem__(self, index: int) -> torch.Tensor:
        item = self._items[index]
        if isinstance(item, Path):
            return torch.load(item, weights_only=True)
        return item

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def copy(self) -> HiddenStore:
        """A second store of the same activations under the same limit (in-memory tensors shared: a store replaces
        its entries, never writes into them)."""
        twin = HiddenStore(self.limit, self.parent)
        for tensor in self:
            twin.append(tensor)
        return twin

    def close(self) -> None:
        self._items.clear()
        self._memory = 0
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
