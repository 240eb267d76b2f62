"""Checking a written GGUF file before it is published.

The reference is the model `hexq run` serves at the export's widths: the artifact's dense part as served, each
routed expert at the replica the file holds (its allocated code, its 4-bit replica, or its K-quant replica decoded
by hexq.packed.ggml), computed by hexq's streamed model (hexq.runtime.model.artifact_model).

- With llama-cpp-python (`pip install 'hexq[gguf]'`): llama.cpp loads the file and computes the logits of every
  held-out window; they are compared with the reference's (relative L2, max |delta|, argmax agreement, perplexity).
  What may differ: llama.cpp's arithmetic, above all the 8-bit blocks it quantizes activations into before every
  product with a quantized weight (Q8_0 / Q8_1 / Q8_K), the float16 rounding of Q4_1's m, and Q8_0's re-rounding of
  asymmetric dense codes. Limit: `LLAMA_LIMIT` (with what was measured); the blocks are checked first (below).
- Always, and alone without llama-cpp-python (one line says so): every tensor of the file is read back with gguf-py
  and dequantized by gguf-py's own block decoders, then compared with the weights hexq serves, element by element,
  against a bound derived from the arithmetic: 0 for a form that is exact, the float16 rounding of m for Q4_1, half
  a step for a re-rounded Q8_0 block, plus float32 rounding (2^-22 |x|) for the order of operations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hexq.artifact.reader import Artifact
from hexq.base.data import eval_text, tokenize
from hexq.base.errors import HexqError
from hexq.eval.perplexity import make_windows
from hexq.export.check import LogitAccumulator
from hexq.export.gguf.write import GgufPlan, reference_expert, row_chunks
from hexq.model.layer_pass import stream_layers
from hexq.packed.ggml import Q4_1, Q8_0
from hexq.packed.weight import PROJECTIONS
from hexq.runtime.model import artifact_model

LLAMA_MISSING = ("llama-cpp-python is not installed (pip install 'hexq[gguf]'): checked every tensor's blocks with "
                 "gguf-py's dequantization instead of running the file in llama.cpp")
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class LlamaLimit:
    """What llama.cpp's logits may differ from hexq's. Measured (4-8 windows): a trained model 0.011 relative L2
    (hexq-tiny-qwen3moe, Q4_1 experts, Q8_0 attention; perplexity -0.03%); random 256-wide models of every family
    with non-uniform attention 0.059-0.089 and argmax agreement 0.86-0.94 (llama.cpp's 8-bit activation blocks, in
    a model whose outputs amplify them); a real mistake, Mixtral's q/k rows not permuted for llama.cpp's rope, 1.17
    and 0.035. Perplexity is reported, not limited: on random weights it moves by 1% with the arithmetic alone."""

    rel_l2: float = 0.2  # logits against the reference
    argmax_agreement: float = 0.8


LLAMA_LIMIT = LlamaLimit()


# ------------------------------------------------------------------------------------------ the reference weights


def export_weights(artifact: Artifact, plan: GgufPlan):
    """expert_weights for hexq.runtime.model.artifact_model: the routed experts at the export's widths."""
    by_row = {layer.row: layer for layer in plan.layers}

    def weights(row: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        layer = by_row[row]
        return tuple(torch.stack([reference_expert(artifact, layer, e, p) for e in experts])
                     for p in PROJECTIONS)

    return weights


# ------------------------------------------------------------------------------------------ without llama.cpp


@dataclass(frozen=True)
class BlockCheck:
    tensors: int
    worst: float  # largest |gguf-py's weight - hexq's| / bound (<= 1 passes); 0 when every tensor is bit-exact
    failed: list[str]

    @property
    def passed(self) -> bool:
        return not self.failed


def _bound(kind_name: str, raw: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-element bound of |decoded - reference| for blocks raw [rows, row_bytes] of `kind_name` (module
    docstring)."""
    slack = reference.abs() * 2.0 ** -22
    if kind_name not in (Q4_1.name, "Q8_0-rtn"):
        return slack
    blocks = raw.reshape(-1, Q4_1.nbytes if kind_name == Q4_1.name else Q8_0.nbytes)
    if kind_name == Q4_1.name:
        m = blocks[:, 2:4].contiguous().view(torch.float16).float().abs()
        per_block = m * 2.0 ** -11 + m * 2.0 ** -22
    else:
        per_block = blocks[:, 0:2].contiguous().view(torch.float16).float() * (0.5 + 2.0 ** -10)
    return slack + per_block.repeat_interleave(32, 1).reshape(reference.shape)


def _same_bytes(written: np.ndarray, stored: torch.Tensor, chunk: int = 1 << 26) -> bool:
    """Whether a tensor written in float holds the stored tensor's bytes, compared a chunk at a time."""
    mine = stored.contiguous().reshape(-1).view(torch.uint8).numpy()
    theirs = np.asarray(written).reshape(-1).view(np.uint8)
    return mine.size == theirs.size and all(np.array_equal(mine[i:i + chunk], theirs[i:i + chunk])
                                            for i in range(0, mine.size, chunk))


def block_check(artifact: Artifact, plan: GgufPlan, path: Path, progress: Progress | None = None) -> BlockCheck:
    """Every tensor of the written file against the weights hexq serves (module docstring), one expert (or one 2-D
    tensor) at a time: quantized tensors dequantized by gguf-py, float ones compared byte for byte."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    planned = {t.name: t for t in plan.tensors}
    missing = sorted(set(planned) ^ set(tensors))
    if missing:
        raise HexqError(f"{path}: tensor {missing[0]} is {'not written' if missing[0] in planned else 'not planned'}")
    worst, failed = 0.0, []
    for done, (name, tensor) in enumerate(tensors.items()):
        entry = planned[name]
        if entry.reference is None:
            if not _same_bytes(tensor.data, entry.make()):
                failed.append(name)
            continue
        kind = entry.type_name if entry.exact else "Q8_0-rtn"
        rows, cols = entry.shape[-2:]
        raw = np.asarray(tensor.data).reshape(entry.parts, rows, -1)
        for part, chunk in ((p, c) for p in range(entry.parts) for c in row_chunks((rows, cols))):
            reference = entry.reference(part, chunk).float()
            blocks = raw[part, chunk]
            written = torch.from_numpy(np.array(quants.dequantize(blocks, tensor.tensor_type), dtype=np.float32))
            written = written.reshape(reference.shape)
            if torch.equal(written, reference):
                continue
            bound = _bound(kind, torch.from_numpy(np.array(blocks)), reference).clamp(min=1e-38)
            excess = float(((written - reference).abs() / bound).max())
            worst = max(worst, excess)
            if excess > 1:
                failed.append(name)
                break
        if progress:
            progress("check blocks", done + 1, len(tensors))
        artifact.release()
    return BlockCheck(len(tensors), worst, failed)


# ------------------------------------------------------------------------------------------ with llama.cpp


def llama_available() -> bool:
    """Whether llama-cpp-python imports: installed, and its libllama found (a binding installed without a library
    of its own, as scripts/llama_cpp.sh does, raises OSError unless LLAMA_CPP_LIB_PATH names one)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def llama_logits(path: Path, windows: torch.Tensor, threads: int | None = None):
    """Logits [L, vocab] (float32) of each window [N, L], computed by llama.cpp from the GGUF file, one window at a
    time from an empty context."""
    from llama_cpp import Llama

    seqlen = windows.shape[1]
    model = Llama(model_path=str(path), n_ctx=seqlen, n_batch=seqlen, n_ubatch=seqlen, logits_all=True,
                  verbose=False, n_threads=threads or torch.get_num_threads())
    try:
        for window in windows:
            model.reset()
            model.eval(window.tolist())
            yield torch.from_numpy(np.array(model.scores[:seqlen], dtype=np.float32))
    finally:
        model.close()


def llama_check(artifact: Artifact, plan: GgufPlan, path: Path, windows: int, seqlen: int, data: str,
                batch_size: int = 4, progress: Progress | None = None):
    """llama.cpp's logits of the file against hexq's at the export's widths (hexq.export.check.Comparison)."""
    reference, tokenizer, prepare = artifact_model(artifact, torch.device("cpu"),
                                                   expert_weights=export_weights(artifact, plan))
    ids = make_windows(tokenize(tokenizer, eval_text(data)), seqlen, windows)
    hidden = stream_layers(reference, ids, batch_size, prepare,
                           progress=(lambda what, done, total: progress("check: hexq", done, total)) if progress
                           else None)
    accumulator = LogitAccumulator()
    try:
        llama = llama_logits(path, ids)
        with reference.parts("model.norm", "lm_head"):
            norm, head = reference.model.model.norm, reference.model.lm_head
            for index, batch in enumerate(ids.split(batch_size)):
                logits = head(norm(hidden[index])).float()
                for row, window in enumerate(batch):
                    targets = torch.cat([window[1:], torch.tensor([-1])])
                    accumulator.add(next(llama), logits[row], targets)
                if progress:
                    progress("check: llama.cpp", min((index + 1) * batch_size, len(ids)), len(ids))
    finally:
        hidden.close()
    return accumulator.result("llama.cpp", "hexq at the export's widths"), int(ids.shape[0])
