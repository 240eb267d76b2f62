"""A Hugging Face MoE checkpoint read one tensor at a time, without building the model.

`Checkpoint` knows the folder's config, which shard holds which tensor (`model.safetensors.index.json`, or a single
`model.safetensors`), and how the hub names things that transformers 5.x renames or fuses when it loads:

- per-expert weights: the hub ships one tensor per expert and projection (Mixtral and PhiMoE
  `block_sparse_moe.experts.{e}.w1/w2/w3`, with w1 = gate, w3 = up, w2 = down; Qwen2/Qwen3-MoE, OLMoE and DeepSeek
  `mlp.experts.{e}.gate_proj/up_proj/down_proj`), while the model holds fused `experts.gate_up_proj [E, 2I, H]`
  (gate rows first, then up) and `experts.down_proj [E, H, I]`;
- module renames (Mixtral and PhiMoE `block_sparse_moe` -> `mlp`, PhiMoE's router `gate` -> `router`).
Checkpoints that already hold the fused layout are read as they are.

Tensors come back in their stored dtype (bf16 for every published MoE): callers upcast only what they compute
with. Every tensor read is checked against the shape the model expects, and every problem (missing shard, missing
tensor, wrong shape, unknown dtype, unreadable file) is a one-line HexqError naming the file and the tensor.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hexq.base.errors import HexqError
from hexq.model.adapters import MoEAdapter, adapter_for
from hexq.model.folder import read_model_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Stored dtypes hexq computes from (every published MoE checkpoint hexq supports is bf16, fp16 or fp32).
KNOWN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


MAPPED_BYTES = 256 << 20  # experts assembled from per-expert tensors between two releases of the shards' maps


class Checkpoint:
    """Read access to a checkpoint folder's safetensors shards, one tensor at a time (mmap through safe_open)."""

    def __init__(self, folder: str | Path, config: dict | None = None) -> None:
        self.folder = Path(folder)
        self.config = config if config is not None else _read_config(self.folder)
        self.adapter: MoEAdapter = adapter_for(self.config.get("model_type"))
        self.weight_map = _weight_map(self.folder)
        self._handles: dict[str, object] = {}
        self._lock = threading.Lock()

    # --------------------------------------------------------------------------------------------- raw access

    def release(self) -> None:
        """Close every shard's memory map: pages read so far stop counting in the process's memory (a streamed
        run calls this after each layer, so its RSS does not grow with the layers it has read)."""
        with self._lock:
            self._handles.clear()

    def _handle(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            with self._lock:
                handle = self._handles.get(shard)
                if handle is None:
                    path = self.folder / shard
                    try:
                        handle = safe_open(str(path), framework="pt")
                    except (OSError, SafetensorError) as err:
                        raise HexqError(f"checkpoint shard {path} is unreadable: {err}") from None
                    self._handles[shard] = handle
        return handle

    def read(self, key: str, shape: tuple[int, ...] | None = None, rows: range | None = None) -> torch.Tensor:
        """Tensor `key` in its stored dtype (on the CPU, read from the mmap), checked against `shape` if given; with
        `rows`, only those rows of its first dimension, reading only their bytes."""
        shard = self.weight_map.get(key)
        if shard is None:
            raise HexqError(f"{self.folder}: tensor {key} is not in the checkpoint")
        handle = self._handle(shard)
        try:
            if rows is None:
                tensor = handle.get_tensor(key)
                stored_shape = tuple(tensor.shape)
            else:
                part = handle.get_slice(key)
                stored_shape = tuple(part.get_shape())
                tensor = part[rows.start:rows.stop]
        except (SafetensorError, OSError, RuntimeError) as err:
            raise HexqError(f"{self.folder / shard}: tensor {key} is unreadable: {err}") from None
        except KeyError:
            raise HexqError(f"{self.folder / shard}: tensor {key} is missing (the index lists it there)") from None
        if tensor.dtype not in KNOWN_DTYPES:
            raise HexqError(f"{self.folder / shard}: tensor {key} has dtype {tensor.dtype}; hexq reads "
                            f"{', '.join(str(d).removeprefix('torch.') for d in KNOWN_DTYPES)}")
        if shape is not None and stored_shape != tuple(shape):
            raise HexqError(f"{self.folder / shard}: tensor {key} has shape {list(stored_shape)}, the model's "
                            f"config needs {list(shape)}")
        return tensor

    # ---------------------------------------------------------------------------------------- model names

    def hub_names(self, name: str) -> list[str]:
        """Checkpoint keys that may hold model parameter `name` (full name, e.g. model.layers.0.mlp.gate.weight):
        the name itself, then the hub's spelling of it."""
        adapter, names = self.adapter, [name]
        hub = name
        if adapter.hub_moe:
            hub = hub.replace(f".{adapter.moe}.", f".{adapter.hub_moe}.")
        if adapter.hub_router:
            hub = hub.replace(f".{adapter.router}.", f".{adapter.hub_router}.")
        if hub != name:
            names.append(hub)
        return names

    def find(self, name: str) -> str | None:
        return next((key for key in self.hub_names(name) if key in self.weight_map), None)

    def has_param(self, name: str) -> bool:
        return self.find(name) is not None

    def param_dtype(self, name: str) -> torch.dtype:
        """The stored dtype of a parameter, read from the shard's header (the tensor is not read)."""
        key = self.find(name)
        if key is None:
            raise HexqError(f"{self.folder}: tensor {' or '.join(self.hub_names(name))} is not in the checkpoint")
        return safetensors_dtype(self._handle(self.weight_map[key]).get_slice(key).get_dtype())

    def read_param(self, name: str, shape: tuple[int, ...], rows: range | None = None) -> torch.Tensor:
        """Model parameter (or persistent buffer) `name` from the checkpoint, in its stored dtype (only `rows` of its
        first dimension when given: Checkpoint.read)."""
        key = self.find(name)
        if key is None:
            tried = " or ".join(self.hub_names(name))
            raise HexqError(f"{self.folder}: tensor {tried} is not in the checkpoint")
        return self.read(key, shape, rows)

    def read_fused_experts(self, prefix: str, num_experts: int, gate_up_shape: tuple[int, int],
                           down_shape: tuple[int, int], rows: range | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [n, 2I, H], down [n, H, I]) of the routed experts `rows` (consecutive ids; None: all E) under
        `prefix` (e.g. model.layers.3.mlp.experts), in the stored dtype: read fused when the checkpoint is fused (only
        those experts' bytes), else assembled from the hub's per-expert tensors into one preallocated tensor each
        (one expert's copy at a time)."""
        rows = range(num_experts) if rows is None else rows
        if rows.step != 1 or rows.start < 0 or rows.stop > num_experts or not len(rows):
            raise ValueError(f"rows must be consecutive experts within 0..{num_experts - 1}, got {rows}")
        fused_gate_up, fused_down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if self.find(fused_gate_up) and self.find(fused_down):
            share = None if rows == range(num_experts) else rows
            return (self.read_param(fused_gate_up, (num_experts, *gate_up_shape), share),
                    self.read_param(fused_down, (num_experts, *down_shape), share))
        gate_name, up_name, down_name = self.adapter.hub_expert_projections
        inner = gate_up_shape[0] // 2

        def expert_key(expert: int, projection: str) -> str:
            return f"{prefix}.{expert}.{projection}.weight"

        first = self.read_param(expert_key(rows.start, gate_name), (inner, gate_up_shape[1]))
        gate_up = torch.empty((len(rows), *gate_up_shape), dtype=first.dtype, device=first.device)
        down = torch.empty((len(rows), *down_shape), dtype=first.dtype, device=first.device)
        expert_bytes = (gate_up[0].numel() + down[0].numel()) * first.element_size()
        for row, expert in enumerate(rows):
            gate_up[row, :inner] = self.read_param(expert_key(expert, gate_name), (inner, gate_up_shape[1]))
            gate_up[row, inner:] = self.read_param(expert_key(expert, up_name), (inner, gate_up_shape[1]))
            down[row] = self.read_param(expert_key(expert, down_name), down_shape)
            if (row + 1) % max(1, MAPPED_BYTES // expert_bytes) == 0:
                # the shards' pages read so far stop counting in RSS: the copy alone holds the experts (without
                # this, a Qwen3-30B-A3B layer's 1.2 GB of experts peaked at twice that)
                self.release()
        return gate_up, down


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def safetensors_dtype(name: str) -> torch.dtype | None:
    """A safetensors header dtype name as a torch dtype (None for one torch has no name for here)."""
    return SAFETENSORS_DTYPES.get(name)


def _read_config(folder: Path) -> dict:
    return read_model_config(folder)


def _weight_map(folder: Path) -> dict[str, str]:
    """{tensor key: shard file name}, from the index when there is one, else from the single shard's header."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise HexqError(f"{index} is not a valid safetensors index ({err})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HexqError(f"{index} has an empty or malformed weight_map")
        missing = sorted({shard for shard in weight_map.values() if not (folder / shard).is_file()})
        if missing:
            raise HexqError(f"{index} names shard {missing[0]}, which is not in {folder}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return dict(weight_map)
    single = folder / SINGLE
    if not single.is_file():
        raise HexqError(f"{folder} has no {INDEX} and no {SINGLE}: not a safetensors checkpoint")
    try:
        with safe_open(str(single), framework="pt") as handle:
            keys = list(handle.keys())
    except (OSError, SafetensorError) as err:
        raise HexqError(f"checkpoint shard {single} is unreadable: {err}") from None
    return dict.fromkeys(keys, SINGLE)
