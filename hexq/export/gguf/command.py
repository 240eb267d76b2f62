"""`hexq export ARTIFACT --format gguf -o model.gguf`: plan, write, check, publish.

The file is written under a hidden temporary name beside the destination (.NAME.tmp-PID) and renamed into place only
after its check passed, so a failed or killed export leaves no partial .gguf under the final name (the next run on
the same destination deletes the leftover). An existing destination is replaced only with --force and only if it is
a GGUF file; the destination is never the artifact or inside it (hexq.base.outputs' rules for folders, for one file).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.base.outputs import TEMP, check_inputs, destination_lock, pid_alive, resolve, sibling
from hexq.export.gguf.check import (
    LLAMA_LIMIT,
    LLAMA_MISSING,
    BlockCheck,
    block_check,
    llama_available,
    llama_check,
)
from hexq.export.gguf.write import GgufPlan, plan_gguf, write_gguf

Progress = Callable[[str, int, int], None]
GGUF_MAGIC = b"GGUF"


@contextmanager
def output_file(out: Path, force: bool, inputs: list[Path]) -> Iterator[Path]:
    """A temporary path beside `out` that becomes `out` when the block completes and is deleted when it raises."""
    target = resolve(out)
    check_inputs(target, inputs)
    if target.exists() or target.is_symlink():
        if not target.is_file():
            raise HexqError(f"output {out} exists and is not a file; pick another name")
        with target.open("rb") as handle:
            is_gguf = handle.read(4) == GGUF_MAGIC
        if not force or not is_gguf:
            raise HexqError(f"output {out} exists; " + ("pass --force to replace it" if is_gguf else
                                                         "it is not a GGUF file, and --force replaces only those"))
    target.parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(target):
        for stale in target.parent.glob(f".{target.name}.{TEMP}-*"):
            pid = stale.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not pid_alive(int(pid)):
                stale.unlink(missing_ok=True)
        tmp = sibling(target, TEMP, os.getpid())
        try:
            yield tmp
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


@dataclass(frozen=True)
class GgufCheck:
    """What the check ran and found: llama.cpp's logits against hexq's (`llama`), or gguf-py's blocks (`blocks`)."""

    engine: str  # "llama.cpp" | "gguf-py"
    note: str
    llama: object | None = None  # hexq.export.check.Comparison
    windows: int = 0
    seqlen: int = 0
    blocks: BlockCheck | None = None
    limit: dict | None = None

    @property
    def passed(self) -> bool:
        if not self.blocks.passed:
            return False
        c = self.llama
        return c is None or (c.rel_l2 <= LLAMA_LIMIT.rel_l2 and c.argmax_agreement >= LLAMA_LIMIT.argmax_agreement)


@dataclass(frozen=True)
class GgufSummary:
    out: Path
    plan: GgufPlan
    check: GgufCheck | None
    file_bytes: int
    seconds: float


def check_file(artifact: Artifact, plan: GgufPlan, path: Path, windows: int, seqlen: int, data: str,
               progress: Progress | None) -> GgufCheck:
    """Every tensor's blocks against hexq's weights (gguf-py), then, with llama-cpp-python, the file run by
    llama.cpp against hexq's model (hexq.export.gguf.check)."""
    blocks = block_check(artifact, plan, path, progress)
    if not blocks.passed or not llama_available():
        return GgufCheck("gguf-py", LLAMA_MISSING if blocks.passed else "blocks differ", blocks=blocks)
    comparison, count = llama_check(artifact, plan, path, windows, seqlen, data, progress=progress)
    return GgufCheck("llama.cpp", f"llama.cpp's logits on {count} windows x {seqlen} of {data}", comparison, count,
                     seqlen, blocks, asdict(LLAMA_LIMIT))


def export_gguf(path: str | Path, out: str | Path, experts: str = "auto", force: bool = False, windows: int = 8,
                seqlen: int = 256, data: str = "austen", check: bool = True,
                progress: Progress | None = None) -> GgufSummary:
    """Write the artifact at `path` as the GGUF file `out` and check it (module docstring)."""
    started = time.time()
    artifact = Artifact(path)
    plan = plan_gguf(artifact, experts)
    with output_file(Path(out), force, [artifact.path]) as tmp:
        write_gguf(artifact, tmp, plan, progress)
        result = check_file(artifact, plan, tmp, windows, seqlen, data, progress) if check else None
        if result is not None and not result.passed:
            raise HexqError(f"GGUF check failed ({result.engine}): {failure(result)}; nothing was written to {out}")
        size = tmp.stat().st_size
    return GgufSummary(Path(out), plan, result, size, time.time() - started)


def failure(result: GgufCheck) -> str:
    if not result.blocks.passed:
        more = f" and {len(result.blocks.failed) - 1} more" if len(result.blocks.failed) > 1 else ""
        return f"tensor {result.blocks.failed[0]}{more} differs from the weights hexq serves beyond its bound"
    c = result.llama
    return (f"logits vs hexq relative L2 {c.rel_l2:.3g}, argmax agreement {c.argmax_agreement:.1%} (limit "
            f"{asdict(LLAMA_LIMIT)}), perplexity {c.ppl_model:.3f} vs {c.ppl_reference:.3f}")


def served_by(check: GgufCheck | None) -> dict[str, str]:
    """Which engines are known to serve the file, from what this export ran (nothing claimed that was not run)."""
    if check is not None and check.engine == "llama.cpp":
        return {"llama.cpp": f"yes: loaded by llama-cpp-python and compared with hexq ({check.note})"}
    why = "the check was skipped" if check is None else "llama-cpp-python is not installed"
    return {"llama.cpp": f"not run here ({why}); its blocks decode to hexq's weights (gguf-py)"
            if check is not None else f"not run here ({why})"}


def gguf_report(artifact_path: Path, summary: GgufSummary) -> dict:
    """What was written and what the check measured (hexq export --json)."""
    plan = summary.plan
    check = summary.check
    return {
        "artifact": str(artifact_path), "format": "gguf", "architecture": plan.family.arch,
        "file_bytes": summary.file_bytes, "served_by": served_by(summary.check),
        "experts": [{"layer": layer.layer, "type": layer.kind.name,
                     "sources": {s: sum(e.source == s for e in layer.experts) for s in
                                 sorted({e.source for e in layer.experts})},
                     "projected": [asdict(e) for e in layer.projected]} for layer in plan.layers],
        "tensors": {t.name: t.type_name for t in plan.tensors},
        "re_rounded": plan.inexact,
        "check": None if check is None else {
            "engine": check.engine, "note": check.note, "passed": check.passed, "limit": check.limit,
            "windows": check.windows, "seqlen": check.seqlen,
            "llama": None if check.llama is None else asdict(check.llama),
            "blocks": None if check.blocks is None else asdict(check.blocks)},
    }
