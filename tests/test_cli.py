import json

import pytest
from typer.testing import CliRunner

from hexq.model.adapters import supported_types
from hexq_cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_version_option():
    from hexq import __version__

    result = run("--version")
    assert result.exit_code == 0 and f"hexq {__version__}" in result.output


def test_every_command_has_help():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("eval", "version"):
        assert command in result.output
        assert run(command, "--help").exit_code == 0


def test_eval_prints_a_table_and_writes_json(tiny_qwen3moe, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out" / "ppl.json"
    result = run("eval", tiny_qwen3moe, "--data", text, "--seqlen", 32, "--windows", 3, "--json", out)
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output
    record = json.loads(out.read_text())
    (row,) = record["results"]
    assert row["windows"] == 3 and row["seqlen"] == 32 and row["tokens_scored"] == 3 * 31
    assert row["perplexity"] > 1


def test_eval_on_a_bundled_corpus_name(tiny_qwen3moe):
    result = run("eval", tiny_qwen3moe, "--data", "austen", "--seqlen", 64, "--windows", 2)
    assert result.exit_code == 0, result.output
    assert "austen" in result.output


def one_line_error(result, *fragments):
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    for fragment in fragments:
        assert fragment in message, message


def test_missing_model_folder(tmp_path):
    one_line_error(run("eval", tmp_path / "nope"), "model folder not found")


def test_folder_without_config(tmp_path):
    one_line_error(run("eval", tmp_path), "not a HuggingFace model folder")


def test_dense_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    one_line_error(run("eval", tmp_path), "dense llama model", "not a Mixture-of-Experts")


def test_unsupported_moe_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_local_experts": 4}))
    one_line_error(run("eval", tmp_path), "unsupported architecture 'gpt_oss'", *supported_types())


@pytest.mark.parametrize(
    ("content", "args", "fragment"),
    [
        ("", ("--seqlen", 16), "text is empty"),
        ("a few words only", ("--seqlen", 64), "text too short"),
        ("word " * 500, ("--seqlen", 4096), "exceeds the model's context of 128 tokens"),
    ],
)
def test_bad_text_and_windows(tiny_qwen3moe, tmp_path, content, args, fragment):
    text = tmp_path / "t.txt"
    text.write_text(content)
    one_line_error(run("eval", tiny_qwen3moe, "--data", text, *args), fragment)


def test_missing_text_file(tiny_qwen3moe, tmp_path):
    one_line_error(run("eval", tiny_qwen3moe, "--data", tmp_path / "none.txt"), "text file not found",
                   "name a corpus: austen")


def test_run_perplexity_shares_eval_s_window_check(mixed_artifact):
    """hexq run --ppl with a window longer than the model's context (128) is the same one-line error as hexq eval's,
    not a perplexity."""
    one_line_error(run("run", mixed_artifact, "--ppl", "austen", "-L", "4096", "-n", "1"), "window length 4096",
                   "context of 128")
    one_line_error(run("eval", mixed_artifact, "-d", "austen", "-L", "4096", "-n", "1"), "window length 4096",
                   "context of 128")


def test_pack_bits_zero_is_refused_not_replaced_by_the_recipe_s(mixed_calibration, tmp_path):
    one_line_error(run("pack", mixed_calibration[0], "--bits", "0", "-o", tmp_path / "a.hexq"),
                   "average-bit budget 0.0 is outside the allowed widths", "pass --bits from")
    one_line_error(run("pack", mixed_calibration[0], "--bits", "9", "-o", tmp_path / "a.hexq"),
                   "average-bit budget 9.0 is outside the allowed widths [1, 2, 3, 4]: pass --bits from 1 to 4")
    assert not (tmp_path / "a.hexq").exists()


def test_pack_below_the_smallest_width_needs_allow_skipping(mixed_calibration, tmp_path):
    """With 0-bit experts allowed (experts-mixed's pack widths 0-8), an average below 1 bit is met only by skipping
    experts: refused in one line naming the flag; with --allow-skipping it packs, warning about every layer whose
    routed experts are all skipped."""
    args = ("pack", mixed_calibration[0], "--recipe", "experts-mixed", "-o", tmp_path / "a.hexq")
    one_line_error(run(*args, "--bits", "0.5"), "below the smallest stored width (1 bits)", "--allow-skipping")
    assert not (tmp_path / "a.hexq").exists()
    done = run(*args, "--bits", "0", "--allow-skipping")
    assert done.exit_code == 0, done.output
    assert "skips every routed expert of layer(s) 0, 1" in " ".join(done.output.split())


def test_device_is_validated_before_any_work(tmp_path):
    for command in (["calibrate", tmp_path, "-o", tmp_path / "out"], ["eval", tmp_path], ["run", tmp_path, "-p", "x"]):
        one_line_error(run(*command, "--device", "banana"), "--device banana")
    assert not (tmp_path / "out").exists()
