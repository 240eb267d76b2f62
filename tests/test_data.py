import json

import pytest
import torch

from hexq.base.data import (
    CORPUS_FILES,
    TRAIN_CORPORA,
    calibration_text,
    calibration_windows,
    corpus_text,
    eval_text,
    sample_windows,
    split_point,
    text_from_file,
)
from hexq.base.errors import HexqError


def test_split_point_cuts_at_a_line_start_near_ninety_percent():
    text = "".join(f"line {i}\n" for i in range(1000))
    cut = split_point(text)
    assert text[cut - 1] == "\n"
    assert 0.89 < cut / len(text) < 0.91


@pytest.mark.parametrize("name", TRAIN_CORPORA)
def test_train_and_heldout_partition_the_corpus(name):
    train, heldout, whole = corpus_text(name, "train"), corpus_text(name, "heldout"), corpus_text(name, "all")
    assert train + heldout == whole
    assert 0.08 < len(heldout) / len(whole) < 0.11


@pytest.mark.parametrize("name", TRAIN_CORPORA)
def test_bundled_calibration_slices_come_from_the_training_part(name):
    piece = calibration_text(name)
    assert 200_000 < len(piece.encode()) < 400_000
    assert piece in corpus_text(name, "train")
    assert piece[:2000] not in corpus_text(name, "heldout")


def test_wikitext2_is_evaluation_only():
    with pytest.raises(HexqError, match="evaluation-only"):
        calibration_text("wikitext2")
    with pytest.raises(HexqError, match="evaluation-only"):
        corpus_text("wikitext2", "train")
    assert eval_text("wikitext2") == corpus_text("wikitext2")


def test_unknown_corpus_lists_known_ones():
    with pytest.raises(HexqError) as info:
        corpus_text("shakespeare")
    assert all(name in str(info.value) for name in CORPUS_FILES)


def test_windows_are_seeded_and_inside_the_stream():
    ids = torch.arange(1000)
    a = sample_windows(ids, 8, 32, seed=3).ids
    b = sample_windows(ids, 8, 32, seed=3).ids
    c = sample_windows(ids, 8, 32, seed=4).ids
    assert a.shape == (8, 32)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(8, 31, dtype=a.dtype))  # contiguous slices
    # every start from the first token to the last whose window has a next token (GPTQ's sampler), none past it
    starts = sample_windows(torch.arange(100), 2000, 10, seed=0).ids[:, 0]
    assert set(starts.tolist()) == set(range(90))


def test_calibration_windows_from_bundled_slices(tokenizer):
    windows = calibration_windows(tokenizer, "bundled", n=4, seqlen=64, seed=0)
    assert windows.ids.shape == (4, 64)
    assert windows.tokens_available > 100_000


def test_local_text_jsonl_and_parquet_files(tmp_path, tokenizer):
    rows = ["The first row of text.", "", "A second row, longer than the first one."]
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(rows))
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": r}) for r in rows))
    parquet = tmp_path / "a.parquet"
    import datasets

    datasets.Dataset.from_dict({"text": rows}).to_parquet(str(parquet))
    assert text_from_file(txt) == "\n".join(rows)
    joined = "The first row of text.\n\nA second row, longer than the first one."
    assert text_from_file(jsonl) == joined
    assert text_from_file(parquet) == joined
    windows = calibration_windows(tokenizer, str(jsonl), n=2, seqlen=4, seed=0)
    assert windows.ids.shape == (2, 4)


def test_bad_text_inputs(tmp_path, tokenizer):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(HexqError, match="empty"):
        calibration_windows(tokenizer, str(empty), n=1, seqlen=8)
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    with pytest.raises(HexqError, match="too short"):
        calibration_windows(tokenizer, str(short), n=1, seqlen=64)
    no_text = tmp_path / "rows.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(HexqError, match="no 'text' column"):
        text_from_file(no_text)
    with pytest.raises(HexqError, match="not found"):
        text_from_file(tmp_path / "missing.txt")
