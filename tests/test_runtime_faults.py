"""litsft/runtime/faults.py: which point and rank a LITSFT_FAULT_AT spec names (several specs, the default rank) and
the in-process actions (enospc, pause until a signal). The killing actions are exercised by the crash tests
of tests/test_fault_injection.py; the inert hook by tests/test_reliability.py."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from launch import DEADLINE_S

from litsft.runtime.faults import FAULT_ENV, fault_point
from litsft.runtime.preemption import PreemptionFlag


def fires(name: str, rank: int = 0) -> bool:
    try:
        fault_point(name, rank)
    except OSError as err:
        assert (err.errno, err.filename) == (errno.ENOSPC, f"(fault injected at {name})")
        return True
    return False


def test_each_spec_of_a_list_names_a_point_and_a_rank_default_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "after_step_3:enospc,save_4_shards_written@2:enospc")
    assert fires("after_step_3") and fires("after_step_3", rank=0)
    assert not fires("after_step_3", rank=1)
    assert fires("save_4_shards_written", rank=2)
    assert not fires("save_4_shards_written", rank=0)
    assert not fires("after_step_30") and not fires("after_step")  # whole names only


def test_pause_creates_its_file_and_returns_once_a_stop_signal_arrives(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    marker = tmp_path / "paused"
    monkeypatch.setenv(FAULT_ENV, f"save_2_before_rename:pause={marker}")
    PreemptionFlag.uninstall()  # one left by an earlier in-process run would have seen its own signals
    flag = PreemptionFlag.install()  # before the signal: SIGUSR1 would otherwise end the process
    flag.report = False

    def signal_once_paused() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if marker.exists():
            os.kill(os.getpid(), signal.SIGUSR1)

    sender = threading.Thread(target=signal_once_paused)
    sender.start()
    try:
        start = time.monotonic()
        fault_point("save_2_before_rename")
        assert flag.received, "returned before the signal"
        assert marker.exists() and time.monotonic() - start < DEADLINE_S
    finally:
        sender.join()  # the signal is sent while the flag still handles it, whatever happened above
        PreemptionFlag.uninstall()
