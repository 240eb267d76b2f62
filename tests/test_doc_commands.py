"""The front door cannot rot: every `hexq` command written in README.md, docs/ and the Makefile names a command and
options the CLI has (each is parsed by the CLI itself, with --help so that nothing runs), and README's command block
runs, in order, on the reference model."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hexq_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
SEPARATORS = {"|", "||", "&&", ";"}
# Not run by the README test: a server (tests/test_serve.py serves it) and the multi-process launch
# (tests/test_distributed.py runs it with 2 and 3 ranks).
NOT_RUN = ("serve", "torchrun")


def hexq_commands(line: str) -> list[list[str]]:
    """The argument lists of every `hexq` invocation on one shell line (after `torchrun ... --no-python`, an env
    assignment or a Makefile's `$(BIN)/`; Makefile variables stand as a placeholder value)."""
    line = re.sub(r"\$\((\w+)\)", "x", line.removeprefix("$ ").strip())
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")  # `a; b`, `a && b`: two commands
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    commands, segment = [], []
    for token in [*tokens, ";"]:
        if token not in SEPARATORS:
            segment.append(token)
            continue
        while segment and re.fullmatch(r"\w+=.*", segment[0]):  # VAR=value hexq ...
            segment.pop(0)
        if segment[:1] == ["torchrun"] and "--no-python" in segment:
            segment = segment[segment.index("--no-python") + 1:]
        if segment and (segment[0] == "hexq" or segment[0].endswith("/hexq")):
            commands.append(segment[1:])
        segment = []
    return commands


def documented(path: Path) -> list[tuple[str, list[str]]]:
    """(the line as written, its arguments) of every hexq command in the file's code blocks (a Makefile: its
    recipe lines)."""
    text = path.read_text()
    return [found for block in (FENCE.findall(text) if path.suffix == ".md" else [text])
            for found in block_commands(block)]


def block_commands(block: str) -> list[tuple[str, list[str]]]:
    """(the line, its arguments) of every hexq command of one code block, continued lines joined."""
    return [(line.strip(), args) for line in block.replace("\\\n", " ").splitlines() for args in hexq_commands(line)]


def runnable(line: str, args: list[str]) -> bool:
    return args[0] not in NOT_RUN and not line.startswith(NOT_RUN)


def run_hexq(args: list[str], cwd: Path, what: str) -> None:
    """One documented command, as typed, in `cwd`: it must exit 0."""
    env = dict(os.environ, KEY="doc-test-key", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "hexq_cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, f"{what}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("path", [*DOCS, ROOT / "Makefile"], ids=lambda p: p.name)
def test_every_documented_command_is_one_the_cli_has(path):
    commands = documented(path)
    least = {"README.md": 10, "Makefile": 4}.get(path.name, 0)  # none found at the front door: a broken scan
    assert len(commands) >= least, commands
    runner = CliRunner()
    wrong = []
    for line, args in commands:
        result = runner.invoke(app, [*args, "--help"])
        if result.exit_code != 0:
            wrong.append(f"{line!r}: {' '.join(re.sub(r'[│╭╮╰╯─]', ' ', result.output).split())[-200:]}")
    assert not wrong, "\n".join(wrong)


def test_the_scan_sees_a_renamed_option():
    """The check above fails on a flag the CLI does not have (as `--budget` was before it became `--fast-tier`)."""
    (args,) = hexq_commands("hexq run model.hexq --ppl austen --budget 1MB   # the old name")
    assert args == ["run", "model.hexq", "--ppl", "austen", "--budget", "1MB"]
    assert CliRunner().invoke(app, [*args, "--help"]).exit_code == 2
    assert hexq_commands("torchrun --nproc_per_node 8 --no-python hexq calibrate MODEL -o cal")[0][:2] == [
        "calibrate", "MODEL"]
    assert hexq_commands("\t$(BIN)/hexq run $(DEMO)/model.hexq --fast-tier $(FAST_TIER) --stats") == [
        ["run", "x/model.hexq", "--fast-tier", "x", "--stats"]]


def readme_block() -> list[tuple[str, list[str]]]:
    """README's "The commands" block: what a newcomer types first."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The commands"):]
    (block, *_) = FENCE.findall(section)
    return block_commands(block)


def test_the_readme_commands_run_on_the_reference_model(tmp_path):
    """Every command of README's block, in its order, in a fresh folder beside the reference model: each exits 0
    (the server and the torchrun launch aside, tested where they are named in NOT_RUN)."""
    (tmp_path / "models").symlink_to(ROOT / "models")
    ran = []
    for line, args in readme_block():
        if runnable(line, args):
            run_hexq(args, tmp_path, line)
            ran.append(args[0])
    assert {"calibrate", "pack", "run", "eval", "export", "report"} <= set(ran), ran


# What the docs' placeholders stand for on the reference models, and what each doc assumes was made before it (its
# commands read them without making them): made once here, in the doc's folder, the way the docs say to make them.
# experts-vllm's groups of 128 need widths the reference models' 192 and 96 are not multiples of: its g32 variant is
# what the docs say to take for such a model.
STAND_INS = {"MODEL": "models/hexq-tiny-qwen3moe", "ORIGINAL": "models/hexq-tiny-qwen3moe",
             "models/hexq-tiny-M": "models/hexq-tiny-mixtral", "TEXT": "austen", "experts-vllm": "experts-vllm-g32"}
ASSUMED = {"model.hexq": ["pack", "cal-mixed", "--bits", "3", "--bank", "online", "-o", "model.hexq"],
           "cal-mixed": ["calibrate", "models/hexq-tiny-qwen3moe", "-r", "experts-mixed", "-d", "bundled", "-n",
                         "16", "-o", "cal-mixed"]}
# A benchmark's own inputs (its real-shaped checkpoint and recipe), a server, a multi-process launch, a layer map.
NOT_RUN_IN_DOCS = ("ckL", "calL", "aL.hexq", "HOST:")
OUTPUTS = ("-o", "--out")


def doc_commands(path: Path) -> list[list[str]]:
    commands = []
    for line, args in documented(path):
        if not runnable(line, args) or any(t in line for t in NOT_RUN_IN_DOCS) or "(hexq." in line:
            continue
        commands.append([STAND_INS.get(token, token) for token in args])
    return commands


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if p.name != "README.md"], ids=lambda p: p.name)
def test_the_docs_commands_run_on_the_reference_model(path, tmp_path):
    """Each doc's commands, in its order, in a fresh folder beside the reference models: each exits 0. A doc lists
    alternatives for one output (pack at 2.5 bits, then at 3), so an output a command names is cleared first; what
    a doc reads without making it is made as ASSUMED says."""
    from hexq.base.data import eval_text

    commands = doc_commands(path)
    if not commands:
        pytest.skip(f"{path.name} has no command to run")
    for name in ("models", "recipes", "tests"):  # the docs' commands are typed at the root of a clone
        (tmp_path / name).symlink_to(ROOT / name)
    text = eval_text("austen")[:60_000]
    (tmp_path / "my_text.txt").write_text(text)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": text[i:i + 6000]}) + "\n"
                                                 for i in range(0, len(text), 6000)))
    made = {args[args.index(flag) + 1] for args in commands for flag in OUTPUTS if flag in args[:-1]}
    assumed = {name for name in ASSUMED if name not in made and any(name in args for args in commands)}
    if "model.hexq" in assumed:
        assumed.add("cal-mixed")  # the artifact is packed from it
    for name in ("cal-mixed", "model.hexq"):
        if name in assumed:
            run_hexq(ASSUMED[name], tmp_path, f"{path.name}: (assumed) {name}")
    for args in commands:
        for flag in OUTPUTS:
            if flag in args[:-1] and "--force" not in args:
                target = tmp_path / args[args.index(flag) + 1]
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        run_hexq(args, tmp_path, f"{path.name}: {' '.join(args)}")
