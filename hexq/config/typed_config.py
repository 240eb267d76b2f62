"""Frozen config dataclasses from plain mappings (parsed YAML): every field type-checked against its annotation and
stored in its canonical type, unknown and missing keys named with the allowed ones, and every problem a one-line
RecipeError naming the dotted key (the recipe sections of hexq.config.recipe are built with it)."""

from __future__ import annotations

import difflib
import functools
import reprlib
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from hexq.base.errors import HexqError


class RecipeError(HexqError):
    """A problem with a recipe. `key` is the dotted path of the offending key relative to the dataclass that
    raised it ("" when the message is already complete); the loader prefixes it with the section it was read from."""

    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"{key} {problem}" if key else problem)

    def under(self, section: str) -> RecipeError:
        if not section or not self.key:
            return self
        return RecipeError(f"{section}.{self.key}", self.problem)


# --------------------------------------------------------------------------------------------- type checking


def describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


def _expected(hint: Any) -> str:
    """What a value of type `hint` looks like in YAML, for error messages."""
    if _is_optional(hint):
        return f"{_expected(_non_none(hint))} or null"
    if typing.get_origin(hint) is tuple:
        return f"a list of {_expected(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    if is_dataclass(hint):
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names[hint]


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _non_none(hint: Any) -> Any:
    (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return inner


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value converted to the canonical Python type): int -> float for numbers, list -> tuple for tuples."""
    if _is_optional(hint):
        return (True, None) if value is None else _coerce(value, _non_none(hint))
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list | tuple):
            return False, value
        items = [_coerce(item, typing.get_args(hint)[0]) for item in value]
        return all(ok for ok, _ in items), tuple(item for _, item in items)
    if is_dataclass(hint):
        return isinstance(value, hint), value
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, hint), value


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(obj: Any) -> None:
    """Type-check every field of a frozen dataclass against its annotation, storing the canonical value."""
    for f in fields(obj):
        hint = hints(type(obj))[f.name]
        ok, value = _coerce(getattr(obj, f.name), hint)
        if not ok:
            raise RecipeError(f.name, f"must be {_expected(hint)}, got {describe(getattr(obj, f.name))}")
        object.__setattr__(obj, f.name, value)


# ------------------------------------------------------------------------------------------ value checks


def check_bits(key: str, bits: int) -> None:
    if not 1 <= bits <= 8:
        raise RecipeError(key, f"must be in 1..8, got {bits}")


def check_width_list(key: str, widths: tuple[int, ...]) -> None:
    """A list of widths (possibly empty): each in 1..8, increasing, no duplicates."""
    for b in widths:
        check_bits(key, b)
    if list(widths) != sorted(set(widths)):
        raise RecipeError(key, f"must be increasing without duplicates, got {list(widths)}")


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RecipeError(key, f"must be one of {', '.join(allowed)}; got {value!r}")


def check_at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise RecipeError(key, f"must be at least {low}, got {value}")


def check_unit(key: str, value: float, *, open_low: bool = False) -> None:
    if not (0 < value <= 1 if open_low else 0 <= value <= 1):
        raise RecipeError(key, f"must be in {'(0, 1]' if open_low else '[0, 1]'}, got {value}")


def check_unused_at_default(obj: Any, selector: str, used_by: dict[str, tuple[str, ...]]) -> None:
    """Fields used only by some values of `selector` (a method or mode) must keep their defaults otherwise."""
    active = getattr(obj, selector)
    defaults = {f.name: f.default for f in fields(obj)}
    for name, users in used_by.items():
        if active not in users and getattr(obj, name) != defaults[name]:
            only = " or ".join(repr(user) for user in users)
            raise RecipeError(name, f"is used only with {selector} {only} ({selector} is {active!r}); remove it")


# ------------------------------------------------------------------------------------------ dict <-> dataclass


def _section_label(path: str) -> str:
    return path or "recipe"


def _unknown_key(key: Any, path: str, allowed: list[str]) -> RecipeError:
    close = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return RecipeError("", f"unknown key {key!r} in {_section_label(path)}{hint}; allowed: {', '.join(allowed)}")


def _nested_class(hint: Any) -> type | None:
    inner = _non_none(hint) if _is_optional(hint) else hint
    return inner if is_dataclass(inner) else None


def build(cls: type, data: Any, path: str) -> Any:
    """An instance of dataclass `cls` from the mapping `data` read at section `path` ("" for the top level)."""
    allowed = [f.name for f in fields(cls)]
    if not isinstance(data, dict):
        raise RecipeError("", f"{_section_label(path)} must be a mapping with keys {', '.join(allowed)}; "
                              f"got {describe(data)}")
    for key in data:
        if key not in allowed:
            raise _unknown_key(key, path, allowed)
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in data:
            raise RecipeError("", f"missing key {f.name!r} in {_section_label(path)}")
    kwargs = {}
    for key, value in data.items():
        nested = _nested_class(hints(cls)[key])
        if nested is not None and isinstance(value, dict):
            value = build(nested, value, f"{path}.{key}" if path else key)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except RecipeError as err:
        raise err.under(path) from None


def to_plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [to_plain(item) for item in value]
    return value
