"""litsft/runtime/run_lock.py: the out_dir lock's refusals and take-overs that tests/test_reliability.py does not cover
(there: a live holder refused, a dead or reused pid and another host's stopped heartbeat taken over): a lock
file being written or left unreadable, an out_dir that is a file, releasing a lock another run took over, and
the holder checks by value."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from litsft.errors import LitsftError
from litsft.runtime.run_lock import (
    LOCK_NAME,
    STALE_AFTER_S,
    RunLock,
    describe,
    holder_alive,
    process_start_time,
    read_holder,
)


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_unreadable_lock_is_refused_while_fresh_and_taken_over_once_old(tmp_path: Path, capsys) -> None:
    """An empty lock file is what a run starting at the same moment has created but not written yet."""
    path = tmp_path / LOCK_NAME
    path.write_text("")
    with pytest.raises(
        LitsftError, match=rf"^another run is starting in {tmp_path}; start one run per --out_dir$"
    ):
        RunLock(tmp_path).acquire()
    assert path.read_text() == ""
    age(path, 11)
    with RunLock(tmp_path):
        assert read_holder(path)["pid"] == os.getpid()
    assert capsys.readouterr().out == f"Taking over {path} from a run that is gone (unreadable lock file)\n"
    assert not path.exists()


def test_a_dead_runs_lock_in_a_read_only_out_dir_is_one_line_and_kept(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preempted run's out_dir mounted read-only (root ignores file modes, so the file system's refusal is
    what the test stands in for): the line says what to do, not only the errno."""
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1, "start_time": 1}))
    age(path, STALE_AFTER_S + 1)

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(LitsftError) as refused:
        RunLock(tmp_path).acquire()
    assert str(refused.value) == (
        f"cannot write to --out_dir {tmp_path}: Read-only file system; make it writable to resume the run "
        "there, or pick a directory you can write to"
    )
    assert path.exists() and capsys.readouterr().out == ""  # no "Taking over" for a lock it could not take


def test_an_out_dir_that_is_a_file_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("mine")
    with pytest.raises(LitsftError, match=rf"^--out_dir {tmp_path / 'out'} is a file; pass a directory$"):
        RunLock(tmp_path / "out").acquire()
    assert (tmp_path / "out").read_text() == "mine"


def test_an_existing_out_dir_is_kept_and_a_created_one_removed_on_release(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        pass
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []
    with RunLock(tmp_path / "new" / "out") as lock:
        (lock.out_dir / "metrics.csv").write_text("step\n")  # the run wrote something: the out_dir stays
    assert (tmp_path / "new" / "out" / "metrics.csv").is_file()


def test_release_leaves_a_lock_that_another_run_took_over(tmp_path: Path) -> None:
    """After a long stall another run may have judged this one stale and taken the lock: it keeps it."""
    lock = RunLock(tmp_path)
    lock.acquire()
    other = {"host": "node-3", "pid": 42, "start_time": 7, "started": "2026-01-01 00:00:00"}
    lock.path.write_text(json.dumps(other))
    lock.release()
    assert read_holder(lock.path) == other


def test_holder_checks_by_value() -> None:
    here, pid = socket.gethostname(), os.getpid()
    assert holder_alive({"host": "node-3", "pid": 1}, age_s=STALE_AFTER_S - 1)
    assert not holder_alive({"host": "node-3", "pid": 1}, age_s=STALE_AFTER_S + 1)
    assert holder_alive({"host": here, "pid": pid, "start_time": process_start_time(pid)}, age_s=1e9)
    assert holder_alive({"host": here, "pid": pid, "start_time": None}, age_s=0)
    assert not holder_alive({"host": here, "pid": "1234"}, age_s=0)
    assert isinstance(process_start_time(pid), int) and process_start_time(2**22 + 1) is None
    assert describe(None) == "unreadable lock file"
    assert describe({"host": "node-3", "pid": 42, "started": "then"}) == "host node-3, pid 42, started then"


def test_read_holder_of_a_missing_broken_or_non_object_file_is_none(tmp_path: Path) -> None:
    path = tmp_path / LOCK_NAME
    assert read_holder(path) is None
    path.write_text("{not json")
    assert read_holder(path) is None
    path.write_text("[1, 2]")
    assert read_holder(path) is None
