"""scripts/mutants.py stays runnable: every mutant's source occurs exactly once in its file and its tests exist, so a
refactor that moves the guarded code fails here, in the default run, instead of stopping the next mutation run part
way through (two stale mutants did: the fingerprint's LATER_SETTINGS and the server's usage line had moved)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mutants():
    spec = importlib.util.spec_from_file_location("hexq_mutants", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = mutants()


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_still_finds_its_source_and_its_tests(mutant):
    source = (ROOT / mutant.file).read_text()
    assert source.count(mutant.old) == 1, f"{mutant.name}: its source occurs {source.count(mutant.old)} times"
    assert mutant.new != mutant.old
    for test in mutant.tests:
        path, _, node = test.partition("::")
        assert (ROOT / path).is_file(), f"{mutant.name}: no test file {path}"
        name = node.split("[")[0]
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{mutant.name}: no test {name} in {path}"
