"""Calibration over several processes (torch.distributed): which rank does what, and the few collectives it needs.

Launched by torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: `env://`), every rank
runs the whole calibration loop over the same windows. The dense part of each layer (the attention groups' smoothing
search, the dense linears' GPTQ, attention) is computed by every rank, identically (it is a small share of a MoE
layer's work, and replicating it costs no communication); the MoE group's routed smoothing search is split like the
experts, each rank scoring its own (hexq.calib.scales.routed_search), its errors summed in rank order. A MoE layer's
routed experts are split: each rank owns one contiguous range of expert ids (`expert_range`, balanced by a cost
model of routed tokens), accumulates their Hessians, builds their replica banks into its rows of the shared bank
file, and measures their loss-table rows and their output at `propagate_bits`. What the next layer needs - the
experts' combined output - is the sum of every rank's part (`sum`, an all_reduce), kept in float64 where a token's
few float32 terms add exactly: the result has the same bits on every rank, as in one process, whatever the order or
timing of the additions. Per-expert tables are summed the same way with zeros in the rows a rank does not own, which
is exact.

Files: rank 0 alone writes the layer files, progress and the manifest; bank rows are written by their owners into
one file rank 0 created (hexq.base.io.SafetensorsWriter, attached), published by rank 0 after a barrier. The output
folder must be on a file system every rank sees (one machine, or a shared file system across nodes).

Failures: every collective runs with a timeout; a rank that dies, runs out of memory or raises makes the others'
next collective fail, and every surviving rank ends with one line naming itself, its host and the layer. Nothing
half-written is published: a layer counts as done only when rank 0 has recorded it after every rank's barrier.
"""

from __future__ import annotations

import bisect
import itertools
import os
import socket
from datetime import timedelta

import torch

from hexq.base.errors import HexqError

TIMEOUT_SECONDS = int(os.environ.get("HEXQ_DIST_TIMEOUT", "1800"))  # one layer's expert work must fit in it
TOKEN_COST = 0.5  # expert cost model: GPTQ per expert = 1, Hessian and loss table per routed token / mean tokens


class Ranks:
    """This process's place in the job (world 1: a single process, every collective a no-op)."""

    def __init__(self, rank: int = 0, world: int = 1, group=None, local_world: int = 1) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.local_world = local_world  # ranks on this machine, sharing its memory
        self.host = socket.gethostname()
        self.layer: int | None = None  # what failures name

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def where(self) -> str:
        at = "" if self.layer is None else f", layer {self.layer}"
        return f"rank {self.rank} of {self.world} on {self.host}{at}"

    # --- collectives (no-ops for a single process)

    def _call(self, what: str, function, *args, **kwargs):
        import torch.distributed as dist

        try:
            return function(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            raise HexqError(f"{self.where()}: {what} with the other ranks failed (another rank died, ran out of "
                            f"memory or timed out after {TIMEOUT_SECONDS} s: HEXQ_DIST_TIMEOUT); "
                            f"{str(exc).splitlines()[0][:160]}") from None

    def barrier(self, what: str) -> None:
        if self.distributed:
            import torch.distributed as dist

            self._call(what, dist.barrier)

    def objects(self, value) -> list:
        """Every rank's `value` (picklable), in rank order."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        self._call("gathering results", dist.all_gather_object, out, value)
        return out

    def broadcast(self, value):
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        self._call("receiving rank 0's state", dist.broadcast_object_list, box, 0)
        return box[0]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor` (same shape everywhere), on every rank (all_reduce: each rank sends and
        receives ~2x its bytes whatever the world size). Callers sum float64 tensors whose float32 terms add exactly
        (or rows where every rank but one holds zeros), so the order the backend adds them in changes no bit."""
        if not self.distributed:
            return tensor
        import torch.distributed as dist

        total = tensor.clone()
        self._call("summing the experts' outputs", dist.all_reduce, total)
        return total

    # --- the split of a layer's experts

    def expert_range(self, tokens: list[int]) -> range:
        """This rank's experts: contiguous ids whose cost (1 + TOKEN_COST x routed tokens / mean tokens) is closest
        to 1/world of the layer's, cut at the boundary nearest each rank's share (every rank computes the same
        cut from the same router counts)."""
        return expert_ranges(tokens, self.world)[self.rank]


def expert_ranges(tokens: list[int], world: int) -> list[range]:
    """Contiguous expert ranges, one per rank, balanced by the cost model of Ranks.expert_range: rank r's range ends
    at the expert boundary whose running cost is nearest r / world of the layer's (the earlier one on a tie), each
    rank keeping at least one expert while there are experts for it, and leaving one for each later rank where there
    are as many experts as ranks."""
    count = len(tokens)
    mean = max(1.0, sum(tokens) / max(1, count))
    prefix = list(itertools.accumulate((1.0 + TOKEN_COST * t / mean for t in tokens), initial=0.0))
    cuts = [0]
    for rank in range(1, world):
        target = prefix[-1] * rank / world
        after = bisect.bisect_left(prefix, target)  # the first boundary at or past the target
        nearest = after - 1 if after > 0 and target - prefix[after - 1] <= prefix[after] - target else after
        low = min(cuts[-1] + 1, count)
        high = count - (world - rank) if count >= world else count
        cuts.append(min(max(nearest, low), high))
    cuts.append(count)
    return [range(cuts[r], cuts[r + 1]) for r in range(world)]


SINGLE = Ranks()  # a single process


def join(device: torch.device) -> tuple[Ranks, torch.device]:
    """This process's Ranks from the launcher's environment (WORLD_SIZE > 1: torch.distributed with gloo on the CPU,
    NCCL on CUDA with the device of LOCAL_RANK), and the device it computes on."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks(), device
    import torch.distributed as dist

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                    timeout=timedelta(seconds=TIMEOUT_SECONDS), rank=rank, world_size=world)
        except (RuntimeError, ValueError, dist.DistError) as exc:
            raise HexqError(f"rank {rank} of {world} on {socket.gethostname()}: cannot join the job "
                            f"({str(exc).splitlines()[0][:160]})") from None
    return Ranks(rank, world, dist.group.WORLD, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))), device


def leave(ranks: Ranks) -> None:
    if ranks.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
