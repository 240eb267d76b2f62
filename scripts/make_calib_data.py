"""Cut the bundled calibration slices in calib_data/ from the training parts of the shared corpora.

Each slice is about 256 KB of whole lines taken from the middle of the corpus's training part (the first
90%), so it never overlaps the held-out tail. Rerunning gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from hexq.base.data import TRAIN_CORPORA, corpus_text

SLICE_CHARS = 256 * 1024
OUT = Path(__file__).resolve().parent.parent / "calib_data"


def middle_slice(text: str, size: int) -> str:
    start = text.find("\n", len(text) // 2 - size // 2) + 1
    end = text.find("\n", start + size) + 1
    return text[start:end]


def main() -> None:
    for name in TRAIN_CORPORA:
        piece = middle_slice(corpus_text(name, "train"), SLICE_CHARS)
        (OUT / f"{name}.txt").write_text(piece, encoding="utf-8")
        print(f"{name}: {len(piece.encode()):,} bytes")


if __name__ == "__main__":
    main()
