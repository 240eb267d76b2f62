"""`hexq export`: write, check, publish (hexq.base.outputs rules), report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.base.outputs import output_folder
from hexq.export.check import CheckResult, check_export
from hexq.export.codec import (
    CtScheme,
    vllm_support,
)
from hexq.export.plan import LayerExport
from hexq.export.write import DEFAULT_SHARD_BYTES, WritePlan, write_export
from hexq.model.folder import source_state

Progress = Callable[[str, int, int], None]
EXPORT_REPORT = "hexq_export.json"


# ------------------------------------------------------------------------------------------ the command


@dataclass(frozen=True)
class ExportSummary:
    out: Path
    layers: list[LayerExport]
    dense: CtScheme
    check: CheckResult | None
    files_bytes: int
    seconds: float


def source_model(artifact: Artifact, given: Path | None) -> tuple[Path | None, str]:
    """The artifact's full-precision source checkpoint if it is still there and unchanged, and why not if not."""
    recorded = artifact.provenance.get("model_path")
    path = given if given is not None else (Path(recorded) if recorded else None)
    if path is None:
        return None, "the artifact does not record its source checkpoint (pass --source)"
    state = source_state(path, artifact.provenance["model_sha256"])
    if state == "gone":
        if given is not None:
            raise HexqError(f"--source {given} is not a folder")
        return None, f"the source checkpoint {path} is gone"
    if state == "changed":
        if given is not None:
            raise HexqError(f"--source {given} is not the checkpoint the artifact was made from (weights hash "
                            "differs)")
        return None, f"the source checkpoint {path} changed since the artifact was made"
    return path, "compared"


def export_artifact(path: str | Path, out: str | Path, experts: str = "auto", force: bool = False,
                    source: Path | None = None, windows: int = 8, seqlen: int = 256, data: str = "austen",
                    check: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Progress | None = None) -> ExportSummary:
    """Write the artifact at `path` as a compressed-tensors checkpoint in `out` (hexq.base.outputs rules: a temporary
    sibling renamed into place only after the check passed), and check it (see the module docstring)."""
    started = time.time()
    artifact = Artifact(path)
    fp_path, note = source_model(artifact, source)
    inputs = [artifact.path] + ([fp_path] if fp_path is not None else [])
    with output_folder(out, kind="checkpoint", force=force, inputs=inputs) as folder:
        plan = write_export(artifact, folder, experts, shard_bytes, progress)
        result = None
        if check:
            projected = any(layer.projected for layer in plan.layers)
            result = check_export(artifact, folder, windows, seqlen, data, fp_path, projected=projected,
                                  progress=progress)
            if fp_path is None:
                result = CheckResult(**{**result.__dict__, "full_precision_note": note})
        report = export_report(artifact, plan, result)
        (folder / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if result is not None and not result.passed:
            s = result.vs_served
            raise HexqError(f"export check failed: logits vs the served model relative L2 {s.rel_l2:.3g}, argmax "
                            f"agreement {s.argmax_agreement:.1%} (limit {result.limit}); nothing was written to "
                            f"{out}")
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return ExportSummary(Path(out), plan.layers, plan.dense, result, size, time.time() - started)


def export_report(artifact: Artifact, plan: WritePlan, result: CheckResult | None) -> dict:
    """What was written and what the check measured, as stored in hexq_export.json."""
    layers = []
    for layer in plan.layers:
        projected = layer.projected
        layers.append({
            "layer": layer.layer, "scheme": layer.scheme.name, "vllm": vllm_support(layer.scheme, experts=True),
            "exact_experts": sum(c.source == "exact" for c in layer.choices),
            "projected": [asdict(c) for c in projected]})
    return {"artifact": str(artifact.path), "dense": {"scheme": plan.dense.name,
                                                      "vllm": vllm_support(plan.dense, experts=False)},
            "experts": layers, "check": None if result is None else asdict(result)}
