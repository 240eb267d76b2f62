"""llama.cpp itself reads hexq's GGUF exports of both reference models: the same tokens as hexq's tokenizer, and
llama-perplexity's perplexity equal to hexq's on the same tokens scored the same way.

llama.cpp's tools are built by scripts/llama_cpp.sh (.ci/run does it and sets HEXQ_LLAMA_CPP_BIN); without them the
tests skip, except under CI=true, where they fail.

The protocol is llama-perplexity's: the token stream cut into chunks of n_ctx, each chunk scored on its second half
(the logits at positions n_ctx/2 .. n_ctx-2 against the next token). hexq computes its side with `hexq eval`'s
streamed model of the artifact (float32, weights dequantized from the codes) on the same chunks and positions. The
export writes every expert's 4-bit codes into Q4_1 blocks and the 8-bit attention into Q8_0 (the same codes; float16
block scales), so the two differ by llama.cpp's arithmetic: it quantizes each matrix input to 8 bits per block of 32
(measured on 6 chunks of 256: 0.04% of perplexity on the Mixtral, 0.005% on the Qwen3-MoE). The bound is 0.5%; a
GGUF whose q/k rows are not in llama.cpp's rope order (the Mixtral export's permutation dropped) is off by far more
(scripts/mutants.py runs that mutant)."""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import IN_CI, REFERENCE_MODELS

BIN = os.environ.get("HEXQ_LLAMA_CPP_BIN")
CHUNKS, N_CTX, BOUND = 6, 256, 0.005
pytestmark = pytest.mark.skipif(not BIN and not IN_CI, reason="llama.cpp's tools are not built (bash "
                                "scripts/llama_cpp.sh, then HEXQ_LLAMA_CPP_BIN=the folder it prints)")


def tool(name: str) -> str:
    assert BIN, "HEXQ_LLAMA_CPP_BIN is not set: .ci/run builds llama.cpp's tools with scripts/llama_cpp.sh"
    path = Path(BIN) / name
    assert path.is_file(), f"{path} is missing: bash scripts/llama_cpp.sh builds it"
    return str(path)


@pytest.fixture(scope="module", params=sorted(REFERENCE_MODELS))
def exported(request, tmp_path_factory):
    """(artifact, gguf, text file) of a reference model: experts-gguf calibration on 8 windows of 128, every expert
    at 4 bits, exported to GGUF; the first 60,000 characters of held-out austen."""
    from dataclasses import replace

    from hexq.base.data import eval_text
    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import Calibration
    from hexq.config.recipe_files import load_recipe
    from hexq.export.gguf.command import export_gguf
    from hexq.pack.stage import Budget, pack

    folder = tmp_path_factory.mktemp(request.param)
    recipe = replace(load_recipe("experts-gguf"), calibration=Calibration(num_samples=8, seqlen=128, seed=0))
    calibrate(REFERENCE_MODELS[request.param], recipe, "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", budget=Budget(avg_bits=4.0))
    export_gguf(folder / "model.hexq", folder / "model.gguf", check=False)
    text = folder / "austen.txt"
    text.write_text(eval_text("austen")[:60000])
    return folder / "model.hexq", folder / "model.gguf", text


def hexq_ids(artifact: Path, text: Path) -> list[int]:
    from hexq.artifact.reader import Artifact
    from hexq.runtime.model import artifact_tokenizer

    return artifact_tokenizer(Artifact(artifact))(text.read_text()).input_ids


def test_llama_cpp_tokenizes_as_hexq(exported):
    artifact, gguf, text = exported
    done = subprocess.run([tool("llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"],
                          capture_output=True, text=True, check=True)
    theirs = [int(t) for t in re.findall(r"-?\d+", done.stdout.strip().splitlines()[-1])]
    assert theirs == hexq_ids(artifact, text)


def llama_perplexity(gguf, text) -> float:
    """llama-perplexity's final estimate on the text. Its logger is a leaked singleton whose worker thread writes the
    lines (llama.cpp common/log.cpp, "logs may be lost if not flushed before the program exits"): on a loaded
    machine the last lines, the estimate among them, are lost although the run succeeded (measured: 3 of 12 runs with
    both cores busy elsewhere; once in a CI run): such a run is repeated, up to 5 runs (under that load a 1e-3
    chance that all lose it)."""
    command = [tool("llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(N_CTX), "--chunks", str(CHUNKS),
               "-t", str(os.cpu_count() or 1), "-b", str(N_CTX)]
    for _ in range(5):
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        found = re.search(r"Final estimate: PPL = ([\d.]+)", done.stdout + done.stderr)
        if found:
            return float(found.group(1))
    output = (done.stdout + done.stderr)[-2000:]
    raise AssertionError(f"llama-perplexity printed no final estimate in 5 runs:\n{output}")


def test_llama_cpp_perplexity_is_hexq_s(exported):
    from hexq.runtime.model import artifact_model

    from reference import stream_logits

    artifact, gguf, text = exported
    theirs = llama_perplexity(gguf, text)
    ids = torch.tensor(hexq_ids(artifact, text)[:CHUNKS * N_CTX]).reshape(CHUNKS, N_CTX)
    streamed, _, prepare = artifact_model(artifact, torch.device("cpu"))
    logits = stream_logits(streamed, ids, prepare, 1)  # [chunks, n_ctx, vocab]
    first = N_CTX // 2
    scored = torch.log_softmax(logits[:, first:N_CTX - 1].double(), dim=-1)
    nll = -scored.gather(-1, ids[:, first + 1:, None]).mean()
    ours = math.exp(float(nll))
    assert abs(theirs / ours - 1) <= BOUND, (theirs, ours)
