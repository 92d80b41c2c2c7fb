"""litsft/runtime/rendezvous.py in this process, with a flag that records how it would end the process: the time limit
read from the environment, the wait ended after it in one line (exit 2), a stop signal ending it at once
(128 + the signal), and nothing left listening afterwards. Two real nodes, one missing, are in
tests/test_reliability.py."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
from launch import DEADLINE_S

from litsft.runtime.rendezvous import (
    DEFAULT_TIMEOUT_S,
    TIMED_OUT_EXIT_CODE,
    TIMEOUT_ENV,
    RendezvousWatch,
    timeout_s,
)


def recording_flag() -> SimpleNamespace:
    """What the watch uses of a PreemptionFlag: its listeners, and exit_at_once, here recorded."""
    flag = SimpleNamespace(listeners=[], exits=[])
    flag.exit_at_once = lambda line, code: flag.exits.append((line, code))
    return flag


def test_the_time_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert timeout_s() == DEFAULT_TIMEOUT_S == 600.0
    monkeypatch.setenv(TIMEOUT_ENV, "")
    assert timeout_s() == 600.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert timeout_s() == 2.5


def test_the_wait_ends_after_the_time_limit_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "0.3")
    flag = recording_flag()
    start = time.monotonic()
    with RendezvousWatch(flag, "waiting for node 1 at host:29500") as watch:
        assert flag.listeners == [watch._on_signal]
        while not flag.exits and time.monotonic() - start < DEADLINE_S:
            time.sleep(0.05)
    assert 0.3 <= time.monotonic() - start < DEADLINE_S
    assert flag.exits == [
        (
            "error: gave up after 0.3 s waiting for node 1 at host:29500; start the same command on every node, "
            f"or set {TIMEOUT_ENV} (seconds) to wait longer",
            TIMED_OUT_EXIT_CODE,
        )
    ]
    assert flag.listeners == []


def test_a_stop_signal_ends_the_wait_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "60")
    flag = recording_flag()
    with RendezvousWatch(flag, "waiting for the other nodes"):
        (listener,) = flag.listeners
        listener(signal.SIGTERM)
    assert flag.exits == [("Stopped by SIGTERM while waiting for the other nodes; nothing was written", 143)]
    assert flag.listeners == []
