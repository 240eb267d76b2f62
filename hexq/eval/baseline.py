"""Perplexity baselines: record one measurement, and fail when a later one is worse than it allows.

A baseline file holds the protocol (data sources, window length, number of windows) and the perplexity on each
source; optionally (recorded with --kl-against) the model the KL divergence was measured against and the mean KLD
on each source. `compare` says, per figure, whether the new value exceeds baseline * (1 + tolerance); lower is
always fine (a better model should not fail CI, though the baseline then deserves an explicit update). The mean KLD
is the finer instrument of the two (hexq.eval.divergence): a regression that moves perplexity by less than its
sampling noise moves it by several percent.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

from hexq.base.errors import HexqError
from hexq.base.io import write_json_atomic

FORMAT = "hexq-ppl-baseline"
VERSION = 1


@dataclass(frozen=True)
class Protocol:
    data: tuple[str, ...]
    seqlen: int
    windows: int | None


@dataclass(frozen=True)
class Comparison:
    data: str
    baseline: float
    now: float
    limit: float
    floor: float = 0.0  # below it: not an improvement to take on trust (see compare)

    @property
    def change(self) -> float:
        return self.now / self.baseline - 1

    @property
    def regressed(self) -> bool:
        return self.now > self.limit

    @property
    def vanished(self) -> bool:
        return self.now < self.floor


def parse_tolerance(text: str) -> float:
    """'0.5%' -> 0.005, '0.005' -> 0.005; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*", str(text))
    if match is None:
        raise ValueError(f"cannot read tolerance {text!r}; write e.g. 0.5% or 0.005")
    value = float(match.group(1)) / (100 if match.group(2) else 1)
    if value >= 1:
        raise ValueError(f"tolerance {text!r} is 100% or more; write e.g. 0.5%")
    return value


@dataclass(frozen=True)
class KLBaseline:
    against: str  # the reference model, as the user gave it
    kld_mean: dict[str, float]


def write_baseline(path: str | Path, target: str, protocol: Protocol, results: dict[str, float],
                   kl: KLBaseline | None = None) -> None:
    write_json_atomic(path, {"format": FORMAT, "version": VERSION, "target": target,
                             "protocol": {"data": list(protocol.data), "seqlen": protocol.seqlen,
                                          "windows": protocol.windows},
                             "perplexity": results}
                      | ({"kl": {"against": kl.against, "kld_mean": kl.kld_mean}} if kl is not None else {}))


def read_kl(path: str | Path) -> KLBaseline | None:
    """The KL section of a baseline file read by `read_baseline` (None when it was recorded without one)."""
    raw = json.loads(Path(path).read_text()).get("kl")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise HexqError(f"baseline {path}: kl must be an object, got {reprlib.repr(raw)}")
    against = field(Path(path), raw, "against", str, "a model path", "kl.")
    values = field(Path(path), raw, "kld_mean", dict, "an object of text: mean KLD", "kl.")
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise HexqError(f"baseline {path}: kl.kld_mean.{name} must be a number >= 0, got {reprlib.repr(value)}")
    return KLBaseline(against, {name: float(value) for name, value in values.items()})


def read_baseline(path: str | Path) -> tuple[Protocol, dict[str, float]]:
    """The protocol and perplexities of a baseline file; any other content is a one-line HexqError naming the file
    and the field that is missing or of the wrong type."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HexqError(f"baseline {path} does not exist; record one with --write-baseline {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HexqError(f"baseline {path} is unreadable: {err}") from None
    if not isinstance(raw, dict):
        raise HexqError(f"{path} is not a hexq perplexity baseline (a JSON {type(raw).__name__}, not an object)")
    if raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise HexqError(f"{path} is not a hexq perplexity baseline (format {raw.get('format')!r}, "
                        f"version {raw.get('version')!r})")
    protocol = field(path, raw, "protocol", dict, "an object")
    data = field(path, protocol, "data", list, "a list of text names", "protocol.")
    if not data or not all(isinstance(name, str) and name for name in data):
        raise HexqError(f"baseline {path}: protocol.data must be a non-empty list of text names, got "
                        f"{reprlib.repr(data)}")
    seqlen = field(path, protocol, "seqlen", int, "an integer >= 2", "protocol.")
    windows = field(path, protocol, "windows", (int, type(None)), "an integer >= 1 or null", "protocol.")
    if seqlen < 2 or (windows is not None and windows < 1):
        raise HexqError(f"baseline {path}: protocol.seqlen must be >= 2 and protocol.windows >= 1 or null, got "
                        f"{seqlen} and {windows}")
    recorded = field(path, raw, "perplexity", dict, "an object of text: perplexity")
    for name, value in recorded.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise HexqError(f"baseline {path}: perplexity.{name} must be a positive number, got {reprlib.repr(value)}")
    if not recorded:
        raise HexqError(f"baseline {path}: perplexity is empty; record the baseline again with --write-baseline")
    return Protocol(tuple(data), seqlen, windows), {name: float(value) for name, value in recorded.items()}


def field(path: Path, parent: dict, name: str, types: type | tuple[type, ...], expected: str, prefix: str = ""):
    """parent[name], checked to be of `types` (bool is not an int here); a HexqError naming file and field if not."""
    if name not in parent:
        raise HexqError(f"baseline {path} has no {prefix}{name} field ({expected}); record it again with "
                        f"--write-baseline")
    value = parent[name]
    wanted = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
        raise HexqError(f"baseline {path}: {prefix}{name} must be {expected}, got {type(value).__name__} "
                        f"{reprlib.repr(value)}")
    return value


def resolve_protocol(baseline: Protocol, data: list[str] | None, seqlen: int | None,
                     windows: int | None) -> Protocol:
    """The baseline's protocol, with any option the user gave checked against it (a different protocol would
    compare different numbers)."""
    given = {"--data": (tuple(data) if data else None, baseline.data), "--seqlen": (seqlen, baseline.seqlen),
             "--windows": (windows, baseline.windows)}
    for option, (value, recorded) in given.items():
        if value is not None and value != recorded:
            raise HexqError(f"{option} {value} differs from the baseline's {recorded}; drop the option to use the "
                            f"baseline's protocol, or record a new baseline")
    return baseline


def compare(baseline: dict[str, float], now: dict[str, float], tolerance: float,
            floor: float = 0.0) -> list[Comparison]:
    """Each figure against its baseline: above baseline * (1 + tolerance) is a regression; below baseline * (1 -
    floor) (floor > 0) is flagged too. The mean KL divergence of a quantized setting is deterministic on one machine
    and moves by a few percent across CPU kinds; one that falls by tens of percent means the quantization it stands for
    is no longer applied (W8A8 silently serving W8A16 drops it by ~70% on the reference models), which a one-sided
    gate would pass as an improvement."""
    missing = sorted(set(baseline) - set(now))
    if missing:
        raise HexqError(f"no new measurement for {', '.join(missing)}")
    return [Comparison(data, value, now[data], value * (1 + tolerance), value * (1 - floor) if floor else 0.0)
            for data, value in baseline.items()]
