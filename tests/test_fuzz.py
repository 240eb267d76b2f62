"""Fuzzing the readers: corrupted artifact and calibration files, and random recipe and baseline shapes.

Every case must end in a one-line HexqError or in the correct result (the same bytes or the same perplexity as
the untouched input) - never another exception (a traceback for the user) and never a silently different number.
Cases are seeded, so a failure names a case that reproduces. HEXQ_FUZZ_CASES sets how many cases each test runs (the
default keeps the suite fast; `HEXQ_FUZZ_CASES=2000 pytest tests/test_fuzz.py` is the full run).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import yaml

from hexq.artifact.inspect import summarize
from hexq.base.errors import HexqError
from hexq.eval.run import evaluate_model
from hexq.pack.stage import Budget, pack

CASES = int(os.environ.get("HEXQ_FUZZ_CASES", "60"))
EVAL = dict(data=["austen"], seqlen=16, max_windows=1, batch_size=1, device="cpu")


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".hexq-output"))


def random_value(rng: random.Random):
    return rng.choice([None, True, -1, 0, 3, 10**12, 2.5, float("nan"), "", "x" * 9, [], {}, [1, "a"], {"k": 1}])


def mutate_json(value, rng: random.Random):
    """A random structural edit somewhere in a JSON value: delete an entry, or replace one with a random value."""
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        if rng.random() < 0.3:
            return {k: v for k, v in value.items() if k != key}
        return value | {key: mutate_json(value[key], rng) if rng.random() < 0.6 else random_value(rng)}
    if isinstance(value, list) and value:
        index = rng.randrange(len(value))
        if rng.random() < 0.3:
            return value[:index] + value[index + 1:]
        return value[:index] + [mutate_json(value[index], rng)] + value[index + 1:]
    return random_value(rng)


def corrupt(path: Path, rng: random.Random) -> str:
    """Damage one file in place and say how."""
    data = path.read_bytes()
    kind = rng.choice(["flip", "truncate", "append", "empty", "delete", "json"])
    if kind == "json" and path.suffix == ".json":
        try:
            edited = mutate_json(json.loads(data), rng)
        except ValueError:
            edited = None
        path.write_text(json.dumps(edited, allow_nan=True))
    elif kind == "flip" and data:
        buffer = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buffer[rng.randrange(len(buffer))] ^= 1 << rng.randrange(8)
        if bytes(buffer) == data:
            return "unchanged"
        path.write_bytes(bytes(buffer))
    elif kind == "truncate" and data:
        path.write_bytes(data[:rng.randrange(len(data))])
    elif kind == "append":
        path.write_bytes(data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
        kind = "delete"
    return kind


def outcome(action) -> tuple[str, object]:
    """("error", message) for a HexqError with a one-line message, ("ok", result) otherwise; any other exception
    propagates and fails the test (it would be a traceback for the user)."""
    try:
        return "ok", action()
    except HexqError as exc:
        assert "\n" not in str(exc), f"a multi-line error: {exc}"
        return "error", str(exc)


def perplexity(target: Path) -> float:
    return evaluate_model(target, **EVAL)[0].result.perplexity


@pytest.fixture(scope="module")
def clean(mixed_calibration, mixed_artifact):
    return {"artifact_ppl": perplexity(mixed_artifact), "calibration_ppl": perplexity(mixed_calibration[0])}


def test_corrupted_artifacts_are_named_or_harmless(mixed_artifact, clean, tmp_path):
    files = files_of(mixed_artifact)
    counts = {"error": 0, "ok": 0}
    for case in range(CASES):
        rng = random.Random(case)
        target = tmp_path / f"case{case}.hexq"
        shutil.copytree(mixed_artifact, target)
        victim = target / rng.choice(files).relative_to(mixed_artifact)
        how = corrupt(victim, rng)

        def run(target=target):
            summary = summarize(target)
            if not summary["checksums_ok"]:
                bad = [name for name, ok in summary["files"].items() if not ok]
                raise HexqError(f"checksum mismatch: {bad}")
            return perplexity(target)

        kind, result = outcome(run)
        counts[kind] += 1
        if kind == "ok":  # accepted: then it must compute exactly what the untouched artifact computes
            assert result == clean["artifact_ppl"], (case, victim.name, how)
        shutil.rmtree(target)
    print(f"artifact fuzz: {CASES} cases, {counts['error']} named errors, {counts['ok']} correct results")


def test_corrupted_calibrations_are_named_or_harmless(mixed_calibration, clean, tmp_path):
    source = mixed_calibration[0]
    files = files_of(source)
    reference = pack(source, tmp_path / "reference.hexq", budget=Budget(avg_bits=2.5)).out
    want = {p.relative_to(reference): p.read_bytes() for p in files_of(reference)}
    counts = {"error": 0, "ok": 0}
    for case in range(CASES):
        rng = random.Random(10_000 + case)
        target = tmp_path / f"case{case}"
        shutil.copytree(source, target)
        victim = target / rng.choice(files).relative_to(source)
        how = corrupt(victim, rng)
        out = tmp_path / f"case{case}.hexq"
        kind, result = outcome(lambda target=target, out=out: pack(target, out, budget=Budget(avg_bits=2.5)).out)
        counts[kind] += 1
        if kind == "ok":  # packed: the artifact must be the one the untouched calibration gives
            got = {p.relative_to(result): p.read_bytes() for p in files_of(result)}
            got.pop(Path("manifest.json"), None), got.pop(Path("manifest.sha256"), None)
            assert got == {k: v for k, v in want.items() if k.name not in ("manifest.json", "manifest.sha256")}, (
                case, victim.name, how)
            shutil.rmtree(result)
        else:
            assert not out.exists()
        kind, result = outcome(lambda target=target: perplexity(target))
        if kind == "ok":
            assert result == clean["calibration_ppl"], (case, victim.name, how)
        shutil.rmtree(target)
    print(f"calibration fuzz: {CASES} cases, {counts['error']} named errors, {counts['ok']} correct results")


def test_random_recipe_shapes_load_or_are_named(tmp_path):
    from hexq.config.recipe_files import load_recipe, recipe_path

    base = yaml.safe_load(recipe_path("experts-mixed").read_text())
    loaded = 0
    for case in range(CASES * 10):
        rng = random.Random(20_000 + case)
        path = tmp_path / f"r{case}.yaml"
        edited = mutate_json(base, rng)
        path.write_text(yaml.safe_dump(edited) if rng.random() < 0.9 else "\x00" + yaml.safe_dump(edited)[1:])
        kind, _ = outcome(lambda path=path: load_recipe(path))
        loaded += kind == "ok"
    print(f"recipe fuzz: {CASES * 10} cases, {loaded} loaded")


def test_random_baseline_shapes_load_or_are_named(tmp_path):
    from hexq.eval.baseline import read_baseline

    base = json.loads(Path("tests/baselines/ppl/mixtral-fp.json").read_text())
    for case in range(CASES * 10):
        rng = random.Random(30_000 + case)
        path = tmp_path / f"b{case}.json"
        path.write_text(json.dumps(mutate_json(base, rng), allow_nan=True))
        outcome(lambda path=path: read_baseline(path))
