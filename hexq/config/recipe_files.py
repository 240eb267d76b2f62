"""Recipe files: a recipe read from a YAML file, or from the name of one shipped with hexq (recipes/*.yaml).

The mapping inside is `hexq.config.recipe`'s (its docstring gives the format and the rules); this module adds what
reading a file needs: a duplicated key fails (PyYAML would keep the last), unreadable or invalid YAML and unknown
names fail with one line listing the bundled recipes.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hexq.base.data import bundled_folder
from hexq.config.recipe import Recipe, recipe_from_dict
from hexq.config.typed_config import RecipeError

if TYPE_CHECKING:  # importlib.resources.abc is Python >= 3.11; only the annotations need it
    from importlib.resources.abc import Traversable

RECIPES_DIR = bundled_folder("recipes")  # the package's recipes/, or the checkout's


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key written twice in one mapping (SafeLoader silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"found duplicate key {key!r}",
                                                        key_node.start_mark)
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def bundled_recipes() -> list[str]:
    """Names of the recipes shipped with hexq (file stems of recipes/*.yaml)."""
    if not RECIPES_DIR.is_dir():
        return []
    return sorted(entry.name.removesuffix(".yaml") for entry in RECIPES_DIR.iterdir() if entry.name.endswith(".yaml"))


def _bundled_list() -> str:
    names = bundled_recipes()
    return f"bundled recipes: {', '.join(names)}" if names else f"no bundled recipes found in {RECIPES_DIR}"


def recipe_path(path_or_name: str | os.PathLike[str]) -> Path | Traversable:
    """The file behind a recipe argument: an existing file, else a bundled name (no folder part, no suffix)."""
    candidate = Path(path_or_name)
    if candidate.is_file():
        return candidate
    if candidate.is_dir():
        raise RecipeError("", f"recipe {candidate} is a folder, not a .yaml file; {_bundled_list()}")
    if candidate.suffix in (".yaml", ".yml") or len(candidate.parts) != 1:
        raise RecipeError("", f"recipe file not found: {candidate}; {_bundled_list()}")
    bundled = RECIPES_DIR.joinpath(f"{candidate.name}.yaml")
    if not bundled.is_file():
        raise RecipeError("", f"unknown recipe {str(path_or_name)!r}; {_bundled_list()} (or pass a .yaml path)")
    return bundled


def _read_yaml(path: Path | Traversable) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError("", f"cannot read recipe {path}: {err}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError("", f"recipe {path} is not valid YAML{where}: {problem}") from None


def load_recipe(path_or_name: str | os.PathLike[str]) -> Recipe:
    """Read a recipe from a YAML file or a bundled recipe name (see `bundled_recipes`)."""
    path = recipe_path(path_or_name)
    data = _read_yaml(path)
    try:
        return recipe_from_dict(data)
    except RecipeError as err:
        raise RecipeError("", f"recipe {path}: {err}") from None
