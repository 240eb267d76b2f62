"""Output folders: one rule for every hexq command that writes a folder, so that no run loses a user's files.

hexq calibrate writes a calibration, hexq pack an artifact, hexq export a checkpoint and hexq report a report: each
a folder, each through this module. The rule:

1. An existing non-empty destination is refused unless `force` (an empty folder, or none, is fine).
2. `force` replaces only a folder hexq wrote, of the same kind. hexq leaves a marker file `.hexq-output.json`
   ({"format": "hexq-output", "kind": ..., "hexq_version": ...}) in every folder it creates. A folder without it
   (the user's own, or one from a hexq older than the marker) is refused even with force, and so is a folder with
   another kind's marker: `hexq pack --force -o CAL` must not delete the calibration CAL that took an hour to make.
   Such folders are the user's to delete.
3. The destination is never one of the inputs being read, never an ancestor of one (replacing it would delete the
   input) and never inside one. Paths are compared after resolving symlinks. Inputs need not exist.
4. Files are written into a hidden temporary sibling and renamed into place at the end, so nothing appears under
   the final name until the output is complete. Replacing an old folder moves it aside first (one rename), renames
   the new one in and only then deletes the old one: at every moment one whole version exists.
5. Hidden siblings left by a killed run are cleaned up by the next run on the same destination: a temporary
   `.NAME.tmp-PID` whose process is gone is deleted, and a moved-aside `.NAME.old-PID` is deleted, or renamed back
   to NAME when the run died between moving it aside and renaming the new version in.
6. A lock per destination (fcntl.flock on the hidden sibling `.NAME.lock`, non-blocking): a second process writing
   the same destination fails at once with a one-line HexqError naming the pid of the first.

Two entry points share these checks and the lock:

`output_folder` for outputs written in one go (pack, export, report). It yields a fresh temporary folder
`.NAME.tmp-PID`; on normal exit the folder is renamed to NAME, on an exception (or Ctrl-C) it is deleted and NAME
is left as it was:

    # hexq pack
    with output_folder(out, kind="artifact", force=force, inputs=[calib_dir]) as tmp:
        write_shards(tmp)
        write_json_atomic(tmp / "manifest.json", manifest)

    # hexq export
    with output_folder(out, kind="checkpoint", force=force, inputs=[artifact]) as tmp:
        model.config.save_pretrained(tmp)
        save_file(tensors, tmp / "model.safetensors")

    # hexq report
    with output_folder(out, kind="report", force=force, inputs=[artifact, results_dir]) as tmp:
        write_bytes_atomic(tmp / "index.html", page)

`resumable_output_folder` for outputs written piece by piece that a rerun continues after a kill (calibrate,
layer by layer). The in-progress folder is the stable hidden sibling `.NAME.partial`, which is kept when the block
raises or the process dies, and resumed by the next run; it becomes NAME once the block completes. The yielded
`PartialOutput` says whether it holds an earlier run's work (`resumed`) and can be emptied (`clear`) when that work
belongs to other inputs:

    # hexq calibrate
    if is_finished_calibration(out, fingerprint):  # the caller's own "nothing to do" check, before any writing
        return
    with resumable_output_folder(out, kind="calibration", force=force, inputs=[model_dir, data_file]) as work:
        done = layers_done(work.path, fingerprint) if work.resumed else 0   # the caller's progress file
        for index in range(done, num_layers):
            save_layer(work.path, index, ...)
            write_progress(work.path, fingerprint, index + 1)

A partial folder without the marker of its kind is refused (it is not hexq's), whatever `force` says.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hexq import __version__
from hexq.base.errors import HexqError
from hexq.base.io import write_json_atomic

MARKER = ".hexq-output.json"
MARKER_FORMAT = "hexq-output"
KINDS = ("calibration", "artifact", "checkpoint", "report")
ARTICLES = {"artifact": "an"}  # "a calibration", "an artifact"
TEMP, ASIDE, PARTIAL, LOCK = "tmp", "old", "partial", "lock"

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class OutputMarker:
    """What `.hexq-output.json` says about a folder: which command's output it is, and which hexq wrote it."""

    kind: str
    hexq_version: str


@dataclass(frozen=True)
class PartialOutput:
    """The in-progress folder of `resumable_output_folder`.

    path: `.NAME.partial`, the folder to write into; final: NAME, where it goes when complete; resumed: path already
    held an earlier run's files when the block started."""

    path: Path
    final: Path
    resumed: bool

    def clear(self) -> None:
        """Delete the earlier run's files (everything but the marker), to start over in the same folder."""
        for entry in self.path.iterdir():
            if entry.name == MARKER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


# ------------------------------------------------------------------------------------------ marker


def read_marker(folder: PathLike) -> OutputMarker | None:
    """The marker of a folder hexq wrote, or None (no marker, or one that is not hexq's)."""
    try:
        raw = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != MARKER_FORMAT or not isinstance(raw.get("kind"), str):
        return None
    return OutputMarker(raw["kind"], str(raw.get("hexq_version", "unknown")))


def write_marker(folder: Path, kind: str) -> None:
    # No date or host: two runs on the same inputs must give the same bytes.
    write_json_atomic(folder / MARKER, {"format": MARKER_FORMAT, "kind": kind, "hexq_version": __version__})


def with_article(kind: str) -> str:
    return f"{ARTICLES.get(kind, 'a')} {kind}"


# ------------------------------------------------------------------------------------------ checks


def resolve(path: PathLike) -> Path:
    """Absolute, with every symlink that exists followed (the final component too)."""
    return Path(path).expanduser().resolve()


def sibling(out: Path, what: str, pid: int | None = None) -> Path:
    """The hidden siblings of NAME: .NAME.tmp-PID, .NAME.old-PID, .NAME.partial, .NAME.lock."""
    return out.parent / (f".{out.name}.{what}" + (f"-{pid}" if pid is not None else ""))


def check_inputs(out: Path, inputs: Iterable[PathLike]) -> None:
    """Refuse a destination that is an input, holds an input, or lies inside one (out is already resolved)."""
    for given in inputs:
        source = resolve(given)
        if out == source:
            raise HexqError(f"output {out} is the input {source}; write to another folder")
        if source.is_relative_to(out):
            raise HexqError(f"output {out} contains the input {source}; replacing it would delete the input, "
                            f"write to another folder")
        if out.is_relative_to(source):
            raise HexqError(f"output {out} is inside the input {source}; write to a folder outside it")


def check_destination(out: Path, kind: str, force: bool) -> None:
    """Rules 1 and 2 of the module docstring for the (resolved) destination `out`."""
    if not out.exists():
        if out.is_symlink():
            raise HexqError(f"output {out} is a broken symbolic link; remove it or pick another folder")
        return
    if not out.is_dir():
        raise HexqError(f"output {out} exists and is not a folder; pick another folder")
    if not any(out.iterdir()):
        return
    marker = read_marker(out)
    if marker is None:
        raise HexqError(f"output {out} is not empty and was not written by hexq (no {MARKER}); pick another "
                        f"folder (--force replaces only folders hexq wrote)")
    if marker.kind != kind:
        raise HexqError(f"output {out} holds {with_article(marker.kind)}, not {with_article(kind)}; pick another "
                        f"folder (--force replaces only {with_article(kind)} folder hexq wrote)")
    if not force:
        raise HexqError(f"output {out} already holds {with_article(kind)}; pass --force to replace it, or pick "
                        f"another folder")


def prepare(out: PathLike, kind: str, force: bool, inputs: Iterable[PathLike]) -> Path:
    """Every check that needs no lock; returns the resolved destination."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}; known: {', '.join(KINDS)}")
    resolved = resolve(out)
    if resolved.parent == resolved:
        raise HexqError(f"output {out} is a file system root; pick a folder below it")
    check_inputs(resolved, list(inputs))
    check_destination(resolved, kind, force)
    return resolved


# ------------------------------------------------------------------------------------------ lock and stale files


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (another user's process counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def destination_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive flock on .NAME.lock (which holds our pid) for the block; fail at once if another holds it.

    The lock file is deleted on release, while still locked. A process that opened the file just before and then
    locks the deleted inode notices that the path no longer names it and tries again with a fresh file."""
    path = sibling(out, LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise HexqError(f"output {out} is being written by another hexq process ({who}); wait for it to finish "
                            f"or pick another folder") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def remove_stale(out: Path) -> None:
    """Clean up after killed runs (rule 5). Called with the lock held, so no live hexq is writing these."""
    if not out.parent.is_dir():
        return
    for entry in sorted(out.parent.iterdir()):
        for what in (TEMP, ASIDE):
            prefix = f".{out.name}.{what}-"
            pid_text = entry.name[len(prefix):]
            if not entry.name.startswith(prefix) or not pid_text.isdigit():
                continue
            pid = int(pid_text)
            if pid != os.getpid() and pid_alive(pid):
                continue  # not ours and still running: a hexq without the lock; leave it alone
            if what == ASIDE and not out.exists() and not out.is_symlink():
                os.replace(entry, out)  # killed between moving the old version aside and renaming the new one in
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def publish(work: Path, out: Path, kind: str, force: bool) -> None:
    """Rename the finished folder `work` to `out`, replacing an old version so that one whole version always
    exists (rule 4). The destination is checked again: it may have changed during a long run."""
    check_destination(out, kind, force)
    if not (work / MARKER).is_file():
        write_marker(work, kind)
    if out.exists():
        aside = sibling(out, ASIDE, os.getpid())
        os.replace(out, aside)
        try:
            os.replace(work, out)
        except BaseException:
            os.replace(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(work, out)


# ------------------------------------------------------------------------------------------ entry points


@contextmanager
def output_folder(out: PathLike, *, kind: str, force: bool = False,
                  inputs: Iterable[PathLike] = ()) -> Iterator[Path]:
    """Write a folder in one go: yields an empty temporary sibling of `out` that becomes `out` when the block
    completes and is deleted when it raises (see the module docstring for the rules and examples).

    kind: one of KINDS (recorded in the marker; --force replaces only a folder of the same kind); inputs: every
    file or folder the command reads (the destination may not be, hold or lie inside one)."""
    inputs = list(inputs)
    target = prepare(out, kind, force, inputs)
    target.parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(target):
        remove_stale(target)
        check_destination(target, kind, force)  # again, under the lock: stale cleanup may have restored a version
        tmp = sibling(target, TEMP, os.getpid())
        tmp.mkdir()
        try:
            write_marker(tmp, kind)
            yield tmp
            publish(tmp, target, kind, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextmanager
def resumable_output_folder(out: PathLike, *, kind: str, force: bool = False,
                            inputs: Iterable[PathLike] = ()) -> Iterator[PartialOutput]:
    """Write a folder piece by piece, resumable after a kill: yields the `PartialOutput` for `.NAME.partial`
    (created, or kept from an earlier run), renamed to NAME when the block completes and kept when it raises.

    Same checks, lock and stale cleanup as `output_folder`; see the module docstring."""
    inputs = list(inputs)
    target = prepare(out, kind, force, inputs)
    partial = sibling(target, PARTIAL)
    check_inputs(partial, inputs)
    target.parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(target):
        remove_stale(target)
        check_destination(target, kind, force)
        resumed = False
        if partial.exists() or partial.is_symlink():
            marker = read_marker(partial) if partial.is_dir() and not partial.is_symlink() else None
            if marker is None or marker.kind != kind:
                raise HexqError(f"{partial} is not an unfinished hexq {kind} (no {kind} marker {MARKER}); delete it "
                                f"or pick another output folder")
            resumed = any(entry.name != MARKER for entry in partial.iterdir())
        else:
            partial.mkdir()
            write_marker(partial, kind)
        yield PartialOutput(partial, target, resumed)
        publish(partial, target, kind, force)
