"""hexq's GGUF against llama.cpp's own quantization of the same model, at equal file size, perplexity by llama.cpp.

    python benchmarks/gguf_quality.py --work DIR --llama-cpp SRC [--models mixtral qwen3moe PATH...]
        [--classes q4 q3_k q2_k] [--samples 128] [--windows 40] [--seqlen 256]

For each model (a reference model by name, or a checkpoint folder) and class:
- hexq: `hexq calibrate -r experts-gguf` (the bundled calibration text, `--samples` windows, seed 0), `hexq pack` at
  4 / 3 / 2 bits on average per expert with the export replicas, `hexq export --format gguf --experts q4|q3_k|q2_k`;
- llama.cpp: its converter on the full-precision checkpoint (convert_hf_to_gguf.py, told the tokenizer's
  pre-tokenizer, "gpt-2", which its hash table does not know), `llama-imatrix` on the same calibration text
  (`--samples` chunks of `--seqlen`), then `llama-quantize` without and with that imatrix, every tensor given the
  type it has in hexq's file (--tensor-type-file), so both files hold the same types: equal size but for the
  metadata (both sizes are reported).
Perplexity of every file is computed by llama.cpp (llama-cpp-python's logits, hexq.export.gguf.check.llama_logits)
on the same held-out windows (hexq.base.data.eval_text: the held-out parts of austen, pydocs, foldoc; GPTQ protocol,
`--windows` windows of `--seqlen` tokens, no BOS). A class whose type cannot hold the model's rows (K-quants need rows
of a multiple of 256 weights; the reference models' are 192, 96 and 384) is recorded as such, not run.

Decode speed of llama.cpp on hexq's GGUF beside `hexq run` is benchmarks/engines.py's.

SRC is a llama.cpp source tree with its tools built in SRC/build/bin (llama-quantize, llama-imatrix); the one
llama-cpp-python 0.3.36 vendors works (`bash scripts/llama_cpp.sh --bench` builds them there). Its converter
imports `sentencepiece` for llama-family models (Mixtral) before it falls back to the BPE tokenizer: pip install it.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from provenance import ROOT, start_run, write_results

REFERENCE = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
CLASSES = {"q4": 4.0, "q3_k": 3.0, "q2_k": 2.0}  # hexq's average bits per expert for each class
TEXTS = ("austen", "pydocs", "foldoc")
HEXQ = [sys.executable, "-m", "hexq_cli.main"]


def run(command: list, log: Path) -> None:
    with log.open("a") as handle:
        handle.write("$ " + " ".join(map(str, command)) + "\n")
        handle.flush()
        subprocess.run([str(c) for c in command], check=True, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)


def convert(model: Path, out: Path, src: Path, log: Path) -> None:
    """llama.cpp's own converter, told the pre-tokenizer (its hash table does not know hexq's tokenizer)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv = ['convert_hf_to_gguf.py', *sys.argv[2:]]; "
            "import convert_hf_to_gguf as c; from conversion.base import TextModel; "
            "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; c.main()")
    run([sys.executable, "-c", code, src, model, "--outfile", out, "--outtype", "bf16"], log)


def rows_fit(model: Path, block: int) -> bool:
    config = json.loads((model / "config.json").read_text())
    widths = [config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]]
    return all(width % block == 0 for width in widths)


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def llama_quantize(src: Path, base: Path, out: Path, types: dict[str, str], imatrix: Path | None, log: Path) -> None:
    """llama-quantize with every tensor at the type it has in hexq's file (the base type: the experts')."""
    type_file = out.with_suffix(".types")
    expert = next(t for name, t in types.items() if name.endswith("ffn_down_exps.weight"))
    quantized = {name: t for name, t in types.items() if t not in ("F32",) and not name.endswith("_norm.weight")}
    type_file.write_text("".join(f"{name.removesuffix('.weight')}={t.lower()}\n" for name, t in quantized.items()
                                 if name not in ("token_embd.weight", "output.weight")))
    command = [src / "build" / "bin" / "llama-quantize", "--tensor-type-file", type_file,
               "--token-embedding-type", types["token_embd.weight"].lower()]
    if "output.weight" in types:
        command += ["--output-tensor-type", types["output.weight"].lower()]
    if imatrix is not None:
        command += ["--imatrix", imatrix]
    run(command + [base, out, expert], log)


def llama_perplexity(path: Path, windows: torch.Tensor) -> float:
    import torch.nn.functional as F

    from hexq.export.gguf.check import llama_logits

    nll, count = 0.0, 0
    for logits, window in zip(llama_logits(path, windows, threads=2), windows, strict=True):
        nll += float(F.cross_entropy(logits[:-1], window[1:], reduction="sum"))
        count += window.numel() - 1
    return math.exp(nll / count)


def eval_windows(model: Path, text: str, seqlen: int, count: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from hexq.base.data import eval_text, tokenize
    from hexq.eval.perplexity import make_windows

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return make_windows(tokenize(tokenizer, eval_text(text)), seqlen, count)


def quality(name: str, model: Path, args, work: Path, log: Path) -> list[dict]:
    from hexq.base.data import calibration_text

    rows = []
    cal = work / f"{name}-cal"
    if not (cal / "manifest.json").is_file():
        run(HEXQ + ["calibrate", model, "-r", "experts-gguf", "-n", args.samples, "-L", args.seqlen, "-o", cal,
                    "--force"], log)
    base, imatrix, text_file = work / f"{name}-bf16.gguf", work / f"{name}.imatrix.gguf", work / "calibration.txt"
    text_file.write_text(calibration_text("bundled"))
    if not base.is_file():
        convert(model, base, args.llama_cpp, log)
    if not imatrix.is_file():
        run([args.llama_cpp / "build" / "bin" / "llama-imatrix", "-m", base, "-f", text_file, "-o", imatrix,
             "-c", args.seqlen, "--chunks", args.samples, "-t", 2], log)
    windows = {text: eval_windows(model, text, args.seqlen, args.windows) for text in args.texts}
    for cls in args.classes:
        row = {"model": name, "class": cls, "seqlen": args.seqlen}
        if cls != "q4" and not rows_fit(model, 256):
            rows.append(row | {"skipped": "K-quants need rows of a multiple of 256 weights"})
            continue
        artifact, ours = work / f"{name}-{cls}.hexq", work / f"{name}-{cls}.hexq.gguf"
        run(HEXQ + ["pack", cal, "-o", artifact, "--bits", CLASSES[cls], "--bank", "export", "--force"], log)
        run(HEXQ + ["export", artifact, "--format", "gguf", "--experts", cls, "-o", ours, "--no-check", "--force"],
            log)
        types = tensor_types(ours)
        files = {"hexq": ours}
        for label, matrix in (("llama.cpp", None), ("llama.cpp imatrix", imatrix)):
            files[label] = work / f"{name}-{cls}-{label.replace(' ', '-').replace('.', '')}.gguf"
            llama_quantize(args.llama_cpp, base, files[label], types, matrix, log)
        row["bytes"] = {label: path.stat().st_size for label, path in files.items()}
        row["types_equal"] = all(tensor_types(path) == types for path in files.values())
        row["ppl"] = {label: {text: llama_perplexity(path, w) for text, w in windows.items()}
                      for label, path in files.items()}
        row["windows"] = {text: int(w.shape[0]) for text, w in windows.items()}
        row["tokens_scored"] = {text: int(w.shape[0]) * (args.seqlen - 1) for text, w in windows.items()}
        rows.append(row)
    return rows


def render(results: dict) -> str:
    lines = ["| model | class | file MiB hexq / llama.cpp / +imatrix | " + " | ".join(
        f"{text}: hexq / llama.cpp / +imatrix" for text in TEXTS) + " | hexq vs +imatrix |",
             "|---|---|---|" + "---|" * len(TEXTS) + "---|"]
    for row in results.get("rows", []):
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['class']} | not run: {row['skipped']} |" + " |" * (len(TEXTS) + 1))
            continue
        sizes = " / ".join(f"{row['bytes'][k] / 2**20:.2f}" for k in ("hexq", "llama.cpp", "llama.cpp imatrix"))
        ppl = row["ppl"]
        cells = [" / ".join(f"{ppl[k][text]:.3f}" for k in ("hexq", "llama.cpp", "llama.cpp imatrix"))
                 if text in ppl["hexq"] else "-" for text in TEXTS]
        gains = [ppl["hexq"][t] / ppl["llama.cpp imatrix"][t] - 1 for t in ppl["hexq"]]
        lines.append(f"| {row['model']} | {row['class']} | {sizes} | " + " | ".join(cells)
                     + f" | {', '.join(f'{g:+.2%}' for g in gains)} |")
    first = next((r for r in results.get("rows", []) if "windows" in r), None)
    if first:
        lines.append("")
        lines.append(f"Perplexity by llama.cpp on held-out windows of {first['seqlen']} tokens: "
                     + ", ".join(f"{t} {n} windows ({first['tokens_scored'][t]:,} tokens)"
                                 for t, n in first["windows"].items()) + ".")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree with build/bin tools")
    parser.add_argument("--models", nargs="+", default=list(REFERENCE))
    parser.add_argument("--classes", nargs="+", choices=list(CLASSES), default=list(CLASSES))
    parser.add_argument("--texts", nargs="+", default=list(TEXTS))
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gguf_quality.json")
    args = parser.parse_args()
    record = start_run(args)
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "commands.log"
    results: dict = {"rows": []}
    for name in args.models:
        model = REFERENCE.get(name, Path(name))
        results["rows"] += quality(name if name in REFERENCE else model.name, model, args, args.work, log)
        write_results(args.out, results, record)
    write_results(args.out, results, record, complete=True)
    print(render(results))


if __name__ == "__main__":
    main()
