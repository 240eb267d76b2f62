"""A hub id works where a folder does: `hexq calibrate OWNER/NAME` resolves it through the local hub cache (offline, as
the test lays the cache out from the reference model), and an id in no cache with the network off is one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hexq.base.errors import HexqError
from tests.conftest import REFERENCE_MODELS, ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A hub cache holding the reference Qwen3-MoE as `hexq-test/tiny-qwen3moe` (the layout huggingface_hub writes:
    models--OWNER--NAME/{refs/main, snapshots/COMMIT/...})."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--hexq-test--tiny-qwen3moe"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in REFERENCE_MODELS["qwen3moe"].iterdir():
        if path.suffix in (".json", ".safetensors"):
            shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def offline(cache) -> dict:
    return dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def test_resolve_finds_the_snapshot_offline(hub_cache):
    code = ("from hexq.model.folder import resolve_model; print(resolve_model('hexq-test/tiny-qwen3moe'))")
    done = subprocess.run([sys.executable, "-c", code], env=offline(hub_cache), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"snapshots/{COMMIT}")


def test_calibrate_a_hub_id_offline(hub_cache, tmp_path):
    out = tmp_path / "cal"
    done = subprocess.run([sys.executable, "-m", "hexq_cli.main", "calibrate", "hexq-test/tiny-qwen3moe", "-r",
                           "experts-mixed", "-n", "2", "-L", "32", "-o", str(out)], env=offline(hub_cache),
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "manifest.json").is_file()


def test_uncached_id_offline_is_one_line(hub_cache, tmp_path):
    done = subprocess.run([sys.executable, "-m", "hexq_cli.main", "calibrate", "hexq-test/absent", "-o",
                           str(tmp_path / "cal")], env=offline(hub_cache), capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout
    message = " ".join((done.stderr + done.stdout).split())
    assert "hexq-test/absent is neither a local folder nor in the hub cache" in message, message
    assert not (tmp_path / "cal").exists()


def test_a_local_folder_wins_and_revision_needs_an_id(tmp_path):
    from hexq.model.folder import resolve_model

    assert resolve_model(REFERENCE_MODELS["qwen3moe"]) == REFERENCE_MODELS["qwen3moe"]
    with pytest.raises(HexqError, match="--revision v1 applies to a hub id"):
        resolve_model(REFERENCE_MODELS["qwen3moe"], "v1")
