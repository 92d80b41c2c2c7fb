"""litsft/runtime/preemption.py in this process: real signals set the flag and reach its listeners, one Ctrl-C asks for
a stop after the step, a second one stops at once (130, or 124 once the stop's checkpoint is published, after
finishing the run), and uninstalling gives the signals back. What a whole run does on a signal is in
tests/test_fault_injection.py."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from launch import DEADLINE_S

from litsft.runtime.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, STOP_SIGNALS, PreemptionFlag


class Exited(Exception):
    """What `os._exit` raises here instead of ending the test process."""


@pytest.fixture
def flag(monkeypatch: pytest.MonkeyPatch) -> Iterator[PreemptionFlag]:
    """A new installed flag whose `exit_at_once` records (line, code) in `flag.exits` instead of exiting."""
    PreemptionFlag.uninstall()  # one left by an earlier in-process run (the engine installs one)
    flag = PreemptionFlag.install()
    flag.exits = []
    monkeypatch.setattr(flag, "exit_at_once", lambda line, code: flag.exits.append((line, code)))
    yield flag
    PreemptionFlag.uninstall()


def send(sig: signal.Signals, until: Callable[[], object]) -> None:
    """Send `sig` to this process and wait for the watching thread to act on it."""
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + DEADLINE_S
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert until(), f"{sig.name} was not acted on"


def test_exit_codes() -> None:
    assert PREEMPTED_EXIT_CODE == 124 and INTERRUPTED_EXIT_CODE == 130
    assert set(STOP_SIGNALS) == {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}


def test_install_is_one_flag_per_process_and_uninstall_gives_the_signals_back() -> None:
    PreemptionFlag.uninstall()
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    flag = PreemptionFlag.install()
    try:
        assert PreemptionFlag.install() is flag
        assert all(signal.getsignal(sig) == flag._handle for sig in STOP_SIGNALS)
    finally:
        PreemptionFlag.uninstall()
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
    assert PreemptionFlag.install() is not flag
    PreemptionFlag.uninstall()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_sets_the_flag_and_reaches_the_listeners(
    flag: PreemptionFlag, sig: signal.Signals
) -> None:
    heard: list[int] = []
    flag.listeners.append(heard.append)
    one_process = SimpleNamespace(world_size=1)
    assert not flag.received and not flag.is_set(one_process)
    send(sig, until=lambda: heard)
    assert heard == [sig] and flag.received and flag.is_set(one_process)
    assert flag.exits == []


def test_a_second_ctrl_c_stops_at_once_losing_the_steps_since_the_last_checkpoint(
    flag: PreemptionFlag, capfd: pytest.CaptureFixture
) -> None:
    heard: list[int] = []
    flag.listeners.append(heard.append)
    send(signal.SIGINT, until=lambda: heard)
    assert flag.received and flag.exits == []
    assert capfd.readouterr().err == (
        "Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: stop at once)\n"
    )
    send(signal.SIGINT, until=lambda: flag.exits)
    assert flag.exits == [
        (
            "Stopped at once by a second Ctrl-C: the steps since the last checkpoint are lost; relaunch the same "
            "command to resume from it",
            INTERRUPTED_EXIT_CODE,
        )
    ]


def test_a_second_ctrl_c_after_the_checkpoint_finishes_the_run_and_loses_nothing(
    flag: PreemptionFlag,
) -> None:
    finished: list[bool] = []
    flag.report = False
    send(signal.SIGINT, until=lambda: flag.received)
    flag.checkpoint_published(lambda: finished.append(True))
    send(signal.SIGINT, until=lambda: flag.exits)
    assert finished == [True]
    assert flag.exits[0] == (
        "Stopped at once by a second Ctrl-C after the checkpoint was written: no step is lost; relaunch the "
        "same command to resume from it",
        PREEMPTED_EXIT_CODE,
    )


def test_a_spawned_rank_ends_with_0_on_a_second_ctrl_c_after_the_checkpoint(flag: PreemptionFlag) -> None:
    """Fabric's launcher reports the stop; its child observer would SIGKILL it on a rank's non-zero exit."""
    flag.stopped_exit_code = 0
    send(signal.SIGINT, until=lambda: flag.received)
    flag.checkpoint_published(lambda: None)
    send(signal.SIGINT, until=lambda: flag.exits)
    assert flag.exits[0][1] == 0


EXITING_RANK = """
import sys, time
import torch  # what a rank has imported: its teardown after Python's is where a SIGINT used to land
from litsft.runtime.preemption import PreemptionFlag
flag = PreemptionFlag.install()
flag.stopped_exit_code = 0
flag.checkpoint_published(lambda: None)
flag.ignore_ctrl_c_while_exiting()
print("exiting", flush=True)
raise SystemExit(0)
"""


def test_a_rank_on_its_way_out_after_a_stop_is_not_ended_by_ctrl_c(tmp_path) -> None:
    """Ctrl-C after Ctrl-C while a spawned rank exits: Python gives SIGINT its default handler back while it
    finalizes, so without `ignore_ctrl_c_while_exiting` such a rank ended by SIGINT (-2, in 10 of 10 runs
    of this test), and Fabric's observer then SIGKILLed the launcher before it reported the stop."""
    import subprocess
    import sys

    for _ in range(2):
        rank = subprocess.Popen([sys.executable, "-c", EXITING_RANK], stdout=subprocess.PIPE, text=True)
        assert rank.stdout.readline() == "exiting\n"
        while rank.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGINT)
            time.sleep(0.0002)
        assert rank.returncode == 0


def test_exit_at_once_runs_before_exit_then_says_one_line(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    def exit_now(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    PreemptionFlag.uninstall()
    flag = PreemptionFlag.install()
    try:
        flag.before_exit = lambda: print("stopping the ranks", flush=True)
        with pytest.raises(Exited) as exited:
            flag.exit_at_once("Stopped", 143)
        assert exited.value.args == (143,)
        assert capfd.readouterr() == ("stopping the ranks\n", "Stopped\n")
        flag.report = False  # another process of the run reports
        with pytest.raises(Exited):
            flag.exit_at_once("Stopped", 143)
        assert capfd.readouterr() == ("stopping the ranks\n", "")
    finally:
        PreemptionFlag.uninstall()
