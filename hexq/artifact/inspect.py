"""A JSON-ready summary of an artifact: sizes per part, bits per layer, budget use, checksums (`hexq inspect`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hexq.artifact.format import HEAD_WEIGHT, MANIFEST
from hexq.artifact.reader import Artifact


def part_of(name: str) -> str:
    if name.startswith("experts/"):
        return "experts"
    if name.startswith("dense/"):
        return "dense (attention, norms, routers, embeddings, head)"
    if name.endswith(".safetensors"):
        return name.removesuffix(".safetensors")
    return "config + tokenizer"


def summarize(path: str | Path) -> dict:
    """Every file's checksum is verified (the whole artifact is read once)."""
    artifact = Artifact(path)
    manifest = artifact.manifest
    files = artifact.verify_all()
    parts: dict[str, dict] = {}
    for name, entry in artifact.files.items():
        part = parts.setdefault(part_of(name), {"part": part_of(name), "files": 0, "bytes": 0, "ok": True})
        part["files"] += 1
        part["bytes"] += entry["bytes"]
        part["ok"] &= files[name]
    manifest_bytes = (artifact.path / MANIFEST).stat().st_size
    parts["manifest"] = {"part": "manifest", "files": 1, "bytes": manifest_bytes, "ok": True}
    allocation = manifest["allocation"]
    costs = {int(b): n for b, n in manifest["accounting"]["expert_bytes_by_bits"].items()}
    hot = manifest["placement"]["hot"]
    moe_layers = manifest["model"]["moe_layers"]
    layers = [{"layer": moe_layers[index], "histogram": {str(b): n for b, n in sorted(Counter(row).items())},
               "average_bits": sum(row) / len(row), "bytes": sum(costs[b] for b in row), "hot": hot[index]}
              for index, row in enumerate(allocation["bits"])]
    head_bits = manifest["dense"]["quantized_linears"].get(HEAD_WEIGHT)
    head = (f"{head_bits}-bit codes" if head_bits else
            "tied to the embeddings" if HEAD_WEIGHT in manifest["dense"]["aliases"] else "as stored")
    budget = allocation["budget"]
    described = (f"{budget['total_bytes']} bytes, {budget['schedule']} over layers" if budget["total_bytes"] is not None
                 else f"{budget['avg_bits']} bits over the model" if budget.get("schedule") == "model"
                 else f"{budget['avg_bits']} bits per layer")
    return {
        "path": str(artifact.path),
        "format_version": manifest["format_version"],
        "hexq_version": manifest["hexq_version"],
        "model": manifest["model"],
        "provenance": manifest["provenance"],
        "parts": list(parts.values()),
        "allocation": {"budget": described, "bits_set": sorted(costs), "average_bits": allocation["average_bits"],
                       "bytes": manifest["accounting"]["allocated_expert_bytes"],
                       "budget_bytes": budget["total_bytes"], "layers": layers},
        "placement": {key: manifest["placement"][key] for key in ("scheme", "hot_per_layer")},
        "accounting": {"stored_experts": manifest["accounting"]["stored_expert_bytes"],
                       "bank_bits": manifest["experts"]["bank_bits"],
                       "bf16_experts": manifest["accounting"]["bf16_expert_bytes"],
                       "experts_vs_bf16": manifest["accounting"]["stored_expert_bytes"]
                       / manifest["accounting"]["bf16_expert_bytes"],
                       "dense": manifest["accounting"]["dense_bytes"], "head": head,
                       "files": sum(entry["bytes"] for entry in artifact.files.values()) + manifest_bytes},
        "files": files,
        "checksums_ok": all(files.values()),
    }
