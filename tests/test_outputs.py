"""hexq.base.outputs: refuse users' folders, replace only hexq's own, never an input; atomic, lock, stale cleanup,
resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hexq.base.errors import HexqError
from hexq.base.outputs import MARKER, output_folder, read_marker, resumable_output_folder

ROOT = Path(__file__).resolve().parent.parent

# A child process that starts writing `argv[1]` and then waits to be killed (or for `argv[3]` seconds).
WRITER = """
import sys, time
from hexq.base.outputs import output_folder, resumable_output_folder
out, mode, wait = sys.argv[1], sys.argv[2], float(sys.argv[3])
if mode == "resumable":
    with resumable_output_folder(out, kind="calibration") as work:
        (work.path / "layer_000.txt").write_text("layer 0")
        print("writing", work.path, flush=True)
        time.sleep(wait)
else:
    with output_folder(out, kind="report", force=True) as tmp:
        (tmp / "index.html").write_text("half a page")
        print("writing", tmp, flush=True)
        time.sleep(wait)
"""


def start_writer(out: Path, mode: str = "once", wait: float = 60.0) -> tuple[subprocess.Popen, Path]:
    """The child process, once it is inside the block; returns it and the folder it is writing into."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(out), mode, str(wait)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()
    assert line.startswith("writing "), child.stderr.read()
    return child, Path(line.split(" ", 1)[1].strip())


def kill_hard(child: subprocess.Popen) -> None:
    child.kill()  # SIGKILL: no finally block, no cleanup
    child.wait()  # reaped, so its pid no longer names a process


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_report_folder(out: Path, text: str, force: bool = False, inputs=()) -> None:
    with output_folder(out, kind="report", force=force, inputs=inputs) as tmp:
        (tmp / "index.html").write_text(text)


def hidden_siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# ------------------------------------------------------------------------------------------ destination rules


def test_new_folder_is_written_with_its_marker_and_nothing_left_beside_it(tmp_path):
    out = tmp_path / "deep" / "report"
    write_report_folder(out, "page")
    assert (out / "index.html").read_text() == "page"
    assert read_marker(out).kind == "report"
    assert json.loads((out / MARKER).read_text())["format"] == "hexq-output"
    assert hidden_siblings(out) == []  # no temporary folder, no lock file


def test_empty_existing_folder_needs_no_force(tmp_path):
    (tmp_path / "out").mkdir()
    write_report_folder(tmp_path / "out", "page")
    assert (tmp_path / "out" / "index.html").read_text() == "page"


@pytest.mark.parametrize("force", [False, True])
def test_user_folder_is_refused_with_and_without_force(tmp_path, force):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(HexqError, match="not written by hexq") as err:
        write_report_folder(out, "page", force=force)
    assert "\n" not in str(err.value) and str(out) in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert hidden_siblings(out) == []


def test_hexq_folder_needs_force_and_is_then_replaced(tmp_path):
    out = tmp_path / "report"
    write_report_folder(out, "first")
    (out / "old-plot.png").write_text("from the first run")
    with pytest.raises(HexqError, match="pass --force to replace it"):
        write_report_folder(out, "second")
    assert (out / "index.html").read_text() == "first"
    write_report_folder(out, "second", force=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "index.html"]  # the old version went as a whole
    assert (out / "index.html").read_text() == "second"
    assert hidden_siblings(out) == []


def test_folder_of_another_kind_is_refused_even_with_force(tmp_path):
    out = tmp_path / "cal"
    with resumable_output_folder(out, kind="calibration") as work:
        (work.path / "layer_000.txt").write_text("an hour of work")
    with pytest.raises(HexqError, match="holds a calibration, not a report"):
        write_report_folder(out, "page", force=True)
    assert (out / "layer_000.txt").exists()


def test_a_file_is_not_a_destination(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(HexqError, match="not a folder"):
        write_report_folder(tmp_path / "out", "page", force=True)


def test_destination_may_not_be_an_input_hold_one_or_lie_inside_one(tmp_path):
    source = tmp_path / "artifact"
    write_report_folder(source, "an input")  # a hexq folder of the same kind: --force alone would replace it
    cases = {source: "is the input", tmp_path: "contains the input", source / "report": "is inside the input"}
    for out, message in cases.items():
        with pytest.raises(HexqError, match=message) as err:
            write_report_folder(out, "page", force=True, inputs=[source])
        assert str(source) in str(err.value) and "\n" not in str(err.value)
    link = tmp_path / "link"
    link.symlink_to(source)
    with pytest.raises(HexqError, match="is the input"):  # the same folder under another name
        write_report_folder(link, "page", force=True, inputs=[source])
    with pytest.raises(HexqError, match="is the input"):
        write_report_folder(source, "page", force=True, inputs=[link])
    assert (source / "index.html").read_text() == "an input"
    write_report_folder(tmp_path / "elsewhere", "page", inputs=[source])  # a sibling is fine


def test_an_error_inside_the_block_leaves_the_previous_version(tmp_path):
    out = tmp_path / "report"
    write_report_folder(out, "first")
    with pytest.raises(RuntimeError), output_folder(out, kind="report", force=True) as tmp:
        (tmp / "index.html").write_text("broken")
        raise RuntimeError("plotting failed")
    assert (out / "index.html").read_text() == "first"
    assert hidden_siblings(out) == []


# ------------------------------------------------------------------------------------------ killed runs, two writers


def test_kill_9_mid_write_leaves_the_previous_version_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "report"
    write_report_folder(out, "previous")
    child, tmp = start_writer(out)
    kill_hard(child)
    assert (out / "index.html").read_text() == "previous"  # nothing of the killed run under the final name
    assert tmp.name == f".report.tmp-{child.pid}" and (tmp / "index.html").read_text() == "half a page"
    write_report_folder(out, "next", force=True)
    assert (out / "index.html").read_text() == "next"
    assert not tmp.exists() and hidden_siblings(out) == []


def test_kill_between_the_two_renames_restores_the_moved_aside_version(tmp_path):
    out = tmp_path / "report"
    write_report_folder(out, "previous")
    pid = dead_pid()
    aside = tmp_path / f".report.old-{pid}"
    out.rename(aside)  # as if killed right after moving the old version aside
    (tmp_path / f".report.tmp-{pid}").mkdir()
    with pytest.raises(HexqError, match="pass --force"):  # the restored version is there again
        write_report_folder(out, "next")
    assert (out / "index.html").read_text() == "previous" and hidden_siblings(out) == []


def test_a_failed_rename_into_place_puts_the_previous_version_back(tmp_path, monkeypatch):
    out = tmp_path / "report"
    write_report_folder(out, "previous")
    rename = os.replace

    def failing(src, dst):
        if Path(src).name.startswith(".report.tmp-"):
            raise OSError("disk went away")
        return rename(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="disk went away"):
        write_report_folder(out, "next", force=True)
    assert (out / "index.html").read_text() == "previous" and hidden_siblings(out) == []


def test_live_process_temporaries_are_left_alone(tmp_path):
    out = tmp_path / "report"
    other = tmp_path / f".report.tmp-{os.getppid()}"  # a live process that is not us
    other.mkdir()
    write_report_folder(out, "page")
    assert other.exists()


def test_second_concurrent_writer_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "report"
    child, _ = start_writer(out)
    try:
        with pytest.raises(HexqError, match=f"another hexq process \\(pid {child.pid}\\)") as err:
            write_report_folder(out, "page", force=True)
        assert "\n" not in str(err.value)
    finally:
        kill_hard(child)
    write_report_folder(out, "page", force=True)  # the kill released the lock
    assert (out / "index.html").read_text() == "page"


def test_two_writers_in_one_process_are_refused_too(tmp_path):
    out = tmp_path / "report"
    with output_folder(out, kind="report"), pytest.raises(HexqError, match=f"pid {os.getpid()}"):
        write_report_folder(out, "page")


# ------------------------------------------------------------------------------------------ resumable


def test_resumable_folder_is_kept_on_failure_and_resumed(tmp_path):
    out = tmp_path / "cal"
    with pytest.raises(RuntimeError), resumable_output_folder(out, kind="calibration") as work:
        assert not work.resumed and work.path.name == ".cal.partial" and work.final == out
        (work.path / "layer_000.txt").write_text("layer 0")
        raise RuntimeError("killed after layer 0")
    assert not out.exists() and (tmp_path / ".cal.partial" / "layer_000.txt").exists()
    with resumable_output_folder(out, kind="calibration") as work:
        assert work.resumed
        assert sorted(p.name for p in work.path.iterdir()) == [MARKER, "layer_000.txt"]
        (work.path / "layer_001.txt").write_text("layer 1")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "layer_000.txt", "layer_001.txt"]
    assert hidden_siblings(out) == []


def test_resumable_folder_survives_kill_9_and_can_be_cleared(tmp_path):
    out = tmp_path / "cal"
    child, partial = start_writer(out, "resumable")
    kill_hard(child)
    assert partial == tmp_path / ".cal.partial" and not out.exists()
    with resumable_output_folder(out, kind="calibration") as work:
        assert work.resumed and (work.path / "layer_000.txt").exists()
        work.clear()  # e.g. the partial run calibrated another model
        assert [p.name for p in work.path.iterdir()] == [MARKER]
        (work.path / "layer_000.txt").write_text("fresh")
    assert (out / "layer_000.txt").read_text() == "fresh"


def test_resumable_rules_match_the_one_shot_rules(tmp_path):
    out = tmp_path / "cal"
    with resumable_output_folder(out, kind="calibration") as work:
        (work.path / "a.txt").write_text("first")
    with pytest.raises(HexqError, match="pass --force"):
        with resumable_output_folder(out, kind="calibration"):
            pass
    with resumable_output_folder(out, kind="calibration", force=True) as work:
        assert not work.resumed
        (work.path / "b.txt").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b.txt"]
    with pytest.raises(HexqError, match="is inside the input"):
        with resumable_output_folder(out / "sub", kind="calibration", inputs=[out]):
            pass
    foreign = tmp_path / ".mine.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not hexq's")
    with pytest.raises(HexqError, match="not an unfinished hexq calibration"):
        with resumable_output_folder(tmp_path / "mine", kind="calibration", force=True):
            pass
    assert (foreign / "notes.txt").exists()
