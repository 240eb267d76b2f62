"""The widths each run-time precision policy (hexq.runtime.policy) may ask of an expert with its default options,
from the artifact's allocation alone: what `hexq pack --bank POLICY` stores for every expert, and the defaults the
policies start from."""

from __future__ import annotations

POLICIES = ("static", "context", "online", "depth")
DEPTH_LOW_BITS = 2  # depth's width for the slots a layer does not keep at high precision (004 §4.2)


def used_widths(allocation: list[list[int]]) -> list[int]:
    """Widths an allocation [L][E] uses, ascending (0 if it skips experts)."""
    return sorted({b for row in allocation for b in row})


def context_bits(used: list[int], table_bits: tuple[int, ...] | list[int]) -> list[int]:
    """context's widths: every width the allocation uses plus every replica width up to its highest."""
    return sorted(set(used) | {b for b in table_bits if b <= used[-1]})


def online_widths(used: list[int], table_bits: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """online's (high, low) widths: the allocation's highest and lowest non-zero widths."""
    nonzero = [b for b in used if b > 0] or [table_bits[0]]
    return nonzero[-1], nonzero[0]


def depth_high_bits(used: list[int], table_bits: tuple[int, ...] | list[int]) -> int:
    """depth's high width: the allocation's highest non-zero width (the widest replica if it skips every expert)."""
    nonzero = [b for b in used if b > 0] or [table_bits[-1]]
    return nonzero[-1]


def policy_widths(name: str, allocation: list[list[int]], table_bits: tuple[int, ...] | list[int]) -> set[int]:
    """Widths policy `name` with its defaults may ask any expert for (0 = skip needs no replica)."""
    used = used_widths(allocation)
    if name == "static":
        return set()
    if name == "context":
        widths = context_bits(used, table_bits)
    elif name == "online":
        widths = online_widths(used, table_bits)
    elif name == "depth":
        widths = (depth_high_bits(used, table_bits), DEPTH_LOW_BITS)
    else:
        raise ValueError(f"unknown precision policy {name!r}; choose one of {', '.join(POLICIES)}")
    return set(widths) - {0}
