"""hexq eval --write-baseline / --baseline: records, passes on the same model, fails on a worse one."""

import json

import pytest
from typer.testing import CliRunner

from hexq.base.errors import HexqError
from hexq.eval.baseline import FORMAT, VERSION, compare, parse_tolerance, read_baseline
from hexq_cli.main import app

runner = CliRunner()


def test_tolerance_and_compare():
    assert parse_tolerance("0.5%") == pytest.approx(0.005) and parse_tolerance("0.01") == 0.01
    with pytest.raises(ValueError, match="cannot read tolerance"):
        parse_tolerance("half")
    rows = compare({"a": 100.0, "b": 10.0}, {"a": 100.4, "b": 10.06}, 0.005)
    assert [r.regressed for r in rows] == [False, True] and not any(r.vanished for r in rows)
    rows = compare({"a": 1.0, "b": 1.0}, {"a": 0.7, "b": 0.5}, 0.1, floor=0.4)
    assert [r.vanished for r in rows] == [False, True] and not any(r.regressed for r in rows)


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
    assert worse.exit_code == 1 and "REGRESSION" in worse.output and "on austen (perplexity" in worse.output
    loose = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "--tolerance", "2%"])
    assert loose.exit_code == 0
    mismatch = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "-L", "64"])
    assert mismatch.exit_code == 1 and "differs from the baseline" in mismatch.output


def test_a_kl_baseline_gates_the_mean_kl_divergence(tiny_qwen3moe, mixed_artifact, tmp_path):
    """Recorded with --kl-against, the baseline's reference model is measured again by --baseline alone, and a mean
    KLD past --kl-tolerance fails even where perplexity stays within its tolerance; so does one past --kl-floor below
    the baseline (the quantization it measured no longer applied)."""
    baseline = tmp_path / "kl.json"
    common = ["-d", "austen", "-L", "32", "-n", "3"]
    result = runner.invoke(app, ["eval", str(mixed_artifact), *common, "--kl-against", str(tiny_qwen3moe),
                                 "--write-baseline", str(baseline)])
    assert result.exit_code == 0, result.output
    data = json.loads(baseline.read_text())
    assert data["kl"]["against"] == str(tiny_qwen3moe) and data["kl"]["kld_mean"]["austen"] > 0
    same = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline)])
    assert same.exit_code == 0 and "mean KLD" in same.output, same.output
    data["kl"]["kld_mean"]["austen"] /= 1.2  # the measurement is now 20% above its baseline; perplexity unchanged
    baseline.write_text(json.dumps(data))
    worse = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline)])
    assert worse.exit_code == 1 and "on austen (mean KLD" in worse.output, worse.output
    loose = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "--kl-tolerance", "25%"])
    assert loose.exit_code == 0, loose.output
    data["kl"]["kld_mean"]["austen"] *= 1.2 * 2  # the measurement is now half its baseline: quantization gone?
    baseline.write_text(json.dumps(data))
    vanished = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline)])
    assert vanished.exit_code == 1 and "VANISHED" in vanished.output and "still applied" in vanished.output
    floor = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline), "--kl-floor", "60%"])
    assert floor.exit_code == 0, floor.output
    data["kl"]["kld_mean"]["austen"] = -1
    baseline.write_text(json.dumps(data))
    bad = runner.invoke(app, ["eval", str(mixed_artifact), "--baseline", str(baseline)])
    assert bad.exit_code == 1 and "kl.kld_mean.austen" in bad.output


GOOD = {"format": FORMAT, "version": VERSION, "target": "model", "protocol": {"data": ["austen"], "seqlen": 32,
                                                                              "windows": 3},
        "perplexity": {"austen": 70.5}}


def reshaped(change: dict) -> dict:
    """GOOD with fields replaced; a key path "a.b" reaches into protocol; None as value deletes the field."""
    data = json.loads(json.dumps(GOOD))
    for key, value in change.items():
        *parents, leaf = key.split(".")
        target = data
        for parent in parents:
            target = target[parent]
        if value is None:
            del target[leaf]
        else:
            target[leaf] = value
    return data


@pytest.mark.parametrize("content, field", [
    ([1, 2], "a JSON list"),
    ("a string", "a JSON str"),
    (reshaped({"protocol": None}), "no protocol field"),
    (reshaped({"protocol": ["austen"]}), "protocol must be an object"),
    (reshaped({"protocol.data": None}), "no protocol.data field"),
    (reshaped({"protocol.data": "austen"}), "protocol.data must be a list"),
    (reshaped({"protocol.data": []}), "protocol.data must be a non-empty list"),
    (reshaped({"protocol.data": [3]}), "protocol.data must be a non-empty list of text names"),
    (reshaped({"protocol.seqlen": "32"}), "protocol.seqlen must be an integer"),
    (reshaped({"protocol.seqlen": True}), "protocol.seqlen must be an integer"),
    (reshaped({"protocol.seqlen": 1}), "protocol.seqlen must be >= 2"),
    (reshaped({"protocol.windows": None}), "no protocol.windows field"),
    (reshaped({"protocol.windows": "all"}), "protocol.windows must be an integer >= 1 or null"),
    (reshaped({"perplexity": None}), "no perplexity field"),
    (reshaped({"perplexity": [70.5]}), "perplexity must be an object"),
    (reshaped({"perplexity": {}}), "perplexity is empty"),
    (reshaped({"perplexity": {"austen": "70.5"}}), "perplexity.austen must be a positive number"),
    (reshaped({"perplexity": {"austen": -1}}), "perplexity.austen must be a positive number"),
])
def test_every_wrong_shape_is_one_line_naming_file_and_field(tmp_path, content, field):
    path = tmp_path / "base.json"
    path.write_text(json.dumps(content))
    with pytest.raises(HexqError, match=field) as err:
        read_baseline(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_the_written_shape_reads_back(tmp_path):
    path = tmp_path / "base.json"
    path.write_text(json.dumps(reshaped({"protocol": {"data": ["austen"], "seqlen": 32, "windows": None}})))
    protocol, recorded = read_baseline(path)
    assert (protocol.data, protocol.seqlen, protocol.windows, recorded) == (("austen",), 32, None, {"austen": 70.5})
