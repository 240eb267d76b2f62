"""The front door and the docs: README.md stays a front door (<= 15 KB), every link between them resolves, and every
table between `<!-- bench:NAME -->` markers is exactly what benchmarks/run_all.py renders from its results file today
(so a table cannot drift from the numbers it claims)."""

from __future__ import annotations

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
