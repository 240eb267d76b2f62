"""The front door and the docs: README.md stays a front door (<= 15 KB), every link between them resolves, and every
table between `<!-- bench:NAME -->` markers is exactly what benchmarks/run_all.py renders from its results file today
(so a table cannot drift from the numbers it claims)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import run_all  # noqa: E402  (benchmarks/ is not a package)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- bench:(\w+) -->\n(.*?)(?=<!-- /bench:\1 -->)", re.S)


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_bytes()) <= 15 * 1024
    assert len(DOCS) > 1


def test_every_source_file_reads_in_one_sitting():
    """Every module of hexq/ and cli/ stays within 450 lines: a file past that holds more than one idea."""
    long = {str(path.relative_to(ROOT)): lines for path in sorted([*(ROOT / "hexq").rglob("*.py"),
                                                                    *(ROOT / "cli").rglob("*.py")])
            if (lines := len(path.read_text().splitlines())) > 450}
    assert not long, long


def _identifiers(node: ast.AST) -> set[str]:
    """Every name, attribute and identifier-like string constant (getattr, typer's command names) under `node`."""
    found = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value.isidentifier():
            found.add(child.value)
    return found


def test_the_library_holds_only_what_it_runs():
    """No public module-level function or class of hexq/ is there only for tests, benchmarks or scripts: starting from
    what module-level code and the CLI's commands use, every definition reached by name is live, and what is never
    reached belongs in benchmarks/ (reference.py holds the references they compare with). By name, so a name shared
    with a live one hides a dead definition: the scan can miss, never accuse wrongly."""
    definitions, live = {}, set()
    for path in sorted([*(ROOT / "hexq").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.decorator_list:
                definitions[(str(path.relative_to(ROOT)), node.name)] = _identifiers(node) - {node.name}
            else:  # module-level code and decorated definitions (the CLI's commands) are where use starts
                live |= _identifiers(node)
    reached, grew = set(), True
    while grew:
        grew = False
        for key, uses in definitions.items():
            if key not in reached and key[1] in live:
                reached.add(key)
                live |= uses
                grew = True
    unused = sorted(f"{path}: {name}" for path, name in definitions.keys() - reached if not name.startswith("_"))
    assert not unused, unused


def test_the_layer_map_is_the_checked_one():
    """docs/development.md's import layers are the ones lint-imports enforces (pyproject's first contract), in order:
    the map a newcomer reads cannot drift from the code."""
    toml = (ROOT / "pyproject.toml").read_text()
    contract = toml[toml.index('containers = ["hexq"]'):]
    layers = contract[contract.index("layers = [\n") + 11:contract.index("\n]")]
    checked = [line.strip().strip('",') for line in layers.splitlines()]
    doc = (ROOT / "docs" / "development.md").read_text()
    block = doc[doc.index("hexq_cli            the commands"):]
    block = block[:block.index("```")]
    drawn = [line[:20].strip() for line in block.splitlines()[1:] if line[:20].strip()]
    assert drawn == checked, (drawn, checked)


def test_the_manifest_is_read_in_one_place():
    """The artifact's manifest is read through hexq.artifact's typed fields, never indexed by key elsewhere."""
    indexed = [str(path.relative_to(ROOT)) for path in sorted([*(ROOT / "hexq").rglob("*.py"),
                                                               *(ROOT / "cli").rglob("*.py")])
               if "artifact" not in path.relative_to(ROOT).parts and 'manifest["' in path.read_text()]
    assert not indexed, indexed


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_tables_are_rendered_from_their_results(doc):
    for name, body in BLOCK.findall(doc.read_text()):
        assert name in run_all.BENCHMARKS, f"{doc.name}: unknown table {name}"
        want = run_all.rendered_block(name)
        assert want is not None, f"{doc.name}: table {name} has no results file"
        assert body == want, f"{doc.name}: table {name} differs from its results file (benchmarks/run_all.py " \
                             f"--render-only --only {name})"
