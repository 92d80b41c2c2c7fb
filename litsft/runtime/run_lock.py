"""One writer per out_dir: a lock file naming the run that holds it, taken before any rank starts.

`out_dir/.litsft.lock` holds the holder's host, pid and start time. A second run into the same out_dir
refuses to start while the holder lives. A lock left behind by a run that died (SIGKILL, OOM killer, a lost
node) is taken over: on the same host when the pid is gone or now belongs to another process, from another
host (a requeued SLURM job lands elsewhere) when the holder's heartbeat, the lock file's modification time
refreshed every HEARTBEAT_S seconds, is older than STALE_AFTER_S.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from litsft.errors import LitsftError

LOCK_NAME = ".litsft.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0


class RunLock:
    """`with RunLock(out_dir):` holds out_dir for the duration of the block."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._created_out_dir = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def acquire(self) -> None:
        self._make_out_dir()
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": process_start_time(os.getpid())}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as err:
                self._remove_created_out_dir()
                raise LitsftError(
                    f"cannot write to --out_dir {self.out_dir}: {err.strerror}; pick a directory you can write to"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump({**me, "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
                f.flush()
                os.fsync(f.fileno())
            self._heartbeat = threading.Thread(target=self._beat, name="litsft-lock-heartbeat", daemon=True)
            self._heartbeat.start()
            return
        raise LitsftError(
            f"could not take {self.path}: other runs keep taking it; start one run per --out_dir"
        )

    def release(self) -> None:
        self._stop.set()
        holder = read_holder(self.path) or {}
        # Only our own lock: after a long stall another run may have judged ours stale and taken over.
        if (holder.get("host"), holder.get("pid")) == (socket.gethostname(), os.getpid()):
            self.path.unlink(missing_ok=True)
        self._remove_created_out_dir()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def _make_out_dir(self) -> None:
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise LitsftError(f"--out_dir {self.out_dir} is a file; pass a directory")
        if not self.out_dir.exists():
            try:
                self.out_dir.mkdir(parents=True)
            except FileExistsError:
                pass
            except OSError as err:
                raise LitsftError(
                    f"cannot create --out_dir {self.out_dir}: {err.strerror}; pick a directory you can write to"
                ) from None
            else:
                self._created_out_dir = True

    def _remove_created_out_dir(self) -> None:
        # A run that failed before writing anything leaves no empty out_dir behind.
        if self._created_out_dir:
            try:
                self.out_dir.rmdir()
            except OSError:
                pass

    def _take_over_if_stale(self) -> None:
        holder = read_holder(self.path)
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        if holder is None:
            if age < 10:  # being written right now by a run starting at the same moment
                raise LitsftError(f"another run is starting in {self.out_dir}; start one run per --out_dir")
        elif holder_alive(holder, age):
            raise LitsftError(
                f"{self.out_dir} is in use by a running litsft run (host {holder.get('host')}, pid "
                f"{holder.get('pid')}, started {holder.get('started')}); wait for it to end or pass another "
                f"--out_dir (if that run is dead, delete {self.path})"
            )
        try:
            self.path.unlink(missing_ok=True)
        except OSError as err:  # a read-only out_dir: the dead run's lock stays, and so does everything else
            raise LitsftError(
                f"cannot write to --out_dir {self.out_dir}: {err.strerror}; make it writable to resume the run "
                "there, or pick a directory you can write to"
            ) from None
        print(f"Taking over {self.path} from a run that is gone ({describe(holder)})", flush=True)


def read_holder(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def holder_alive(holder: dict[str, Any], age_s: float) -> bool:
    if holder.get("host") != socket.gethostname():
        return age_s < STALE_AFTER_S
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    start_time = holder.get("start_time")
    # The pid was reused by a process that started later: the holder is gone.
    return start_time is None or process_start_time(pid) in (None, start_time)


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), telling a pid's reuse from its holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "unreadable lock file"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
