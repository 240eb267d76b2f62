"""hexq eval --write-baseline / --baseline: records, passes on the same model, fails on a worse one."""

import json

import pytest
from typer.testing import CliRunner

from hexq.eval.baseline import compare, parse_tolerance
from hexq_cli.main import app

runner = CliRunner()


def test_tolerance_and_compare():
    assert parse_tolerance("0.5%") == pytest.approx(0.005) and parse_tolerance("0.01") == 0.01
    with pytest.raises(ValueError, match="cannot read tolerance"):
        parse_tolerance("half")
    rows = compare({"a": 100.0, "b": 10.0}, {"a": 100.4, "b": 10.06}, 0.005)
    assert [r.regressed for r in rows] == [False, True]


def test_cli_baseline_round_trip_and_regression(tiny_qwen3moe, mixed_artifact, tmp_path):
    baseline = tmp_path / "base.json"
    common = ["-d", "austen", "-L", "32", "-n", "3"]
    result = runner.invoke(app, ["eval", str(mixed_artifact), *common, "--write-baseline", str(baseline)])
    assert result.exit_code == 0, result.output
    same = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline)])
    assert same.exit_code == 0 and "ok" in same.output, same.output
    # the full-precision model scored against the 2.5-bit artifact's baseline is better: not a regression;
    # a baseline 1% better than the measurement is
    data = json.loads(baseline.read_text())
    data["perplexity"]["austen"] *= 0.99
    baseline.write_text(json.dumps(data))
    worse = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "--tolerance", "0.5%"])
    assert worse.exit_code == 1 and "REGRESSION" in worse.output and "perplexity regression on austen" in worse.output
    loose = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "--tolerance", "2%"])
    assert loose.exit_code == 0
    mismatch = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "-L", "64"])
    assert mismatch.exit_code == 1 and "differs from the baseline" in mismatch.output
