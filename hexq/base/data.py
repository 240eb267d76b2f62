"""Text sources: the shared corpora with their train/held-out split, bundled calibration slices,
and a loader that turns any of them into fixed-seed token windows.

Held-out rule: the last 10% of each training corpus (cut at a line boundary) is never trained or
calibrated on; WikiText-2 (test split only) is evaluation-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hexq.base.errors import HexqError

if TYPE_CHECKING:  # importlib.resources.abc is Python >= 3.11; only the annotations need it
    from importlib.resources.abc import Traversable

TRAIN_CORPORA = ("austen", "pydocs", "foldoc")
EVAL_ONLY_CORPORA = ("wikitext2",)
CORPUS_FILES = {
    "austen": "austen.txt",
    "pydocs": "pydocs.txt",
    "foldoc": "foldoc.txt",
    "wikitext2": "wikitext2_test.txt",
}
HELDOUT_FRACTION = 0.10

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # hexq/base/data.py -> the source tree


def bundled_folder(name: str) -> Traversable:
    """A data folder shipped with hexq: "recipes" or "calib_data".

    They live at the top of the source tree; a regular install carries them inside the package as hexq/recipes and
    hexq/calib_data (pyproject.toml maps them there), read through importlib.resources. A source checkout or an
    editable install has no such folders in the package and reads the top-level ones."""
    installed = resources.files("hexq").joinpath(name)
    return installed if installed.is_dir() else PROJECT_ROOT / name


CALIB_DIR = bundled_folder("calib_data")


def corpora_dir() -> Path:
    """Where the shared corpora live: $HEXQ_CORPORA, else ../shared/data/corpora beside the project."""
    env = os.environ.get("HEXQ_CORPORA")
    path = Path(env) if env else PROJECT_ROOT.parent / "shared" / "data" / "corpora"
    if not path.is_dir():
        raise HexqError(f"corpora folder not found at {path}; set HEXQ_CORPORA to the folder holding the .txt corpora")
    return path


def read_text(path: Path | Traversable) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HexqError(f"text file not found: {path}") from None
    except UnicodeDecodeError:
        raise HexqError(f"{path} is not UTF-8 text") from None


def split_point(text: str, heldout_fraction: float = HELDOUT_FRACTION) -> int:
    """Character offset where the held-out tail starts: the first line start at or after (1-f) of the text."""
    cut = int(len(text) * (1.0 - heldout_fraction))
    newline = text.find("\n", cut)
    return len(text) if newline < 0 else newline + 1


def corpus_text(name: str, part: str = "all") -> str:
    """Text of a shared corpus. part: 'train' (first 90%), 'heldout' (last 10%) or 'all'."""
    if name not in CORPUS_FILES:
        raise HexqError(f"unknown corpus {name!r}; known: {', '.join(CORPUS_FILES)}")
    text = read_text(corpora_dir() / CORPUS_FILES[name])
    if part == "all":
        return text
    if name in EVAL_ONLY_CORPORA:
        if part == "train":
            raise HexqError(f"{name} is evaluation-only and has no training part")
        return text
    cut = split_point(text)
    if part == "train":
        return text[:cut]
    if part == "heldout":
        return text[cut:]
    raise HexqError(f"unknown corpus part {part!r}; use train, heldout or all")


def eval_text(source: str) -> str:
    """Evaluation text for `hexq eval`: a corpus name (held-out part for training corpora, whole file for
    WikiText-2) or a path to a local text/jsonl/parquet file."""
    if source in CORPUS_FILES:
        return corpus_text(source, "heldout")
    return text_from_file(Path(source))


def text_from_file(path: Path) -> str:
    """A .txt file as is; a .jsonl/.json/.parquet file's `text` column joined with blank lines (the GPTQ
    protocol's "\\n\\n".join over dataset rows)."""
    if not path.exists():
        raise HexqError(f"text file not found: {path} (or name a corpus: {', '.join(CORPUS_FILES)})")
    suffix = path.suffix.lower()
    if suffix in {".jsonl", ".json", ".parquet"}:
        return "\n\n".join(_dataset_rows(path))
    return read_text(path)


def _dataset_rows(path: Path) -> list[str]:
    import datasets

    builder = "parquet" if path.suffix.lower() == ".parquet" else "json"
    try:
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for malformed files
        raise HexqError(f"cannot read {path} as {builder}: {exc}") from None
    if "text" not in dataset.column_names:
        raise HexqError(f"{path} has no 'text' column (columns: {', '.join(dataset.column_names)})")
    return [row for row in dataset["text"] if row]


def calibration_text(source: str) -> str:
    """Calibration text: 'bundled' (all calib_data slices), one slice name (austen, pydocs, foldoc),
    a local text/jsonl/parquet file, or a hub dataset name 'name[:config]' when a hub is reachable."""
    if source == "bundled":
        return "\n\n".join(read_text(CALIB_DIR / f"{name}.txt") for name in TRAIN_CORPORA)
    if source in TRAIN_CORPORA:
        return read_text(CALIB_DIR / f"{source}.txt")
    if source in EVAL_ONLY_CORPORA:
        raise HexqError(f"{source} is evaluation-only: never calibrate on it")
    path = Path(source)
    if path.exists():
        return text_from_file(path)
    return _hub_text(source)


def _hub_text(name: str) -> str:
    import datasets

    dataset_name, _, config = name.partition(":")
    try:
        dataset = datasets.load_dataset(dataset_name, config or None, split="train")
    except Exception as exc:
        raise HexqError(
            f"{name!r} is neither a bundled slice, a local file, nor a reachable dataset ({type(exc).__name__})"
        ) from None
    return "\n\n".join(row for row in dataset["text"] if row)


@dataclass(frozen=True)
class TokenWindows:
    """N windows of L token ids, drawn with a fixed seed; `tokens_available` is the tokenized length."""

    ids: torch.Tensor  # [n, seqlen] int64
    tokens_available: int


def sample_windows(token_ids: torch.Tensor, n: int, seqlen: int, seed: int) -> TokenWindows:
    """n random windows of seqlen tokens (GPTQ's calibration sampler: uniform start offsets, fixed seed)."""
    total = int(token_ids.numel())
    if total < seqlen + 1:
        raise HexqError(f"text too short: {total} tokens, need more than {seqlen} for one window")
    generator = torch.Generator(device=token_ids.device).manual_seed(seed)
    starts = torch.randint(0, total - seqlen, (n,), generator=generator, device=generator.device)
    return TokenWindows(torch.stack([token_ids[s : s + seqlen] for s in starts.tolist()]), total)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Tokenize once, as one stream, without special tokens."""
    if not text.strip():
        raise HexqError("text is empty")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long, device="cpu")  # token ids are born on the CPU, like the text


def calibration_windows(tokenizer, source: str, n: int, seqlen: int, seed: int = 0) -> TokenWindows:
    """The calibration loader: any source `calibration_text` accepts -> n windows of seqlen tokens."""
    return sample_windows(tokenize(tokenizer, calibration_text(source)), n, seqlen, seed)
