"""`hexq export`: an artifact projected onto one scheme per layer and written as a compressed-tensors checkpoint.

vLLM's fused MoE kernels need every expert of a layer in one scheme, so the artifact's per-expert widths are
projected per layer: "auto" gives a layer W4A16 (4-bit groups of 128, pack-quantized) when its experts average at
most 4 bits in the artifact's allocation and W8A8 (int8 channels, dynamic per-token activations) otherwise.
The experts are re-quantized from the artifact's widest replica (8 bits: the closest to full precision the
artifact keeps) with round-to-nearest, because GPTQ needs Hessians the artifact does not store. Attention is
re-quantized to W8A8 from its dequantized weights. The export is then reloaded through `load_exported` (which
checks every tensor against the file) and its logits compared with hexq's own dequantized reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hexq.adapters import adapter_for
from hexq.artifact.export import SCHEMES, W4_GROUP_SIZE, export_compressed_tensors, load_exported
from hexq.artifact.format import Artifact
from hexq.errors import HexqError
from hexq.runtime.model import build_model


@dataclass(frozen=True)
class ExportSummary:
    out: Path
    layer_schemes: list[str]
    max_logit_diff: float


def project_schemes(allocation: list[list[int]], scheme: str) -> list[str]:
    """One scheme per layer: `scheme` everywhere, or "auto" from each layer's mean allocated width."""
    if scheme == "auto":
        return ["w4a16" if sum(row) / len(row) <= 4 else "w8a8" for row in allocation]
    if scheme not in SCHEMES:
        raise HexqError(f"unknown scheme {scheme!r}; choose auto, {', '.join(SCHEMES)}")
    return [scheme] * len(allocation)


def export_artifact(path: str | Path, out: str | Path, scheme: str = "auto",
                    group_size: int = W4_GROUP_SIZE) -> ExportSummary:
    artifact = Artifact(path)
    widest = max(artifact.replica_bits)

    def widest_replicas(layer: int, experts: torch.nn.Module) -> torch.nn.Module:
        weights = [artifact.expert_weights(layer, e, widest) for e in range(artifact.num_experts)]
        experts.gate_up_proj.data = torch.stack([w[0] for w in weights])
        experts.down_proj.data = torch.stack([w[1] for w in weights])
        return experts

    model, tokenizer, _ = build_model(artifact, widest_replicas, "cpu")
    schemes = project_schemes(artifact.allocation, scheme)
    adapter = adapter_for(artifact.manifest["model"]["model_type"])
    reference = export_compressed_tensors(model, tokenizer, adapter, schemes, out, group_size)
    expected = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    expected.load_state_dict(reference, strict=False)
    loaded = load_exported(out)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((loaded(ids).logits - expected(ids).logits).abs().max())
    return ExportSummary(Path(out), schemes, diff)
