"""Waiting for every process of a run to join, with an end: a time limit and the stop signals.

While the processes meet (torch.distributed's rendezvous) the main thread sits in C++ code where Python
signal handlers cannot run, and it would wait as long as the process group's timeout (30 minutes) for a
node that may never come. `RendezvousWatch` ends the wait from a thread instead, on a timeout or on any
stop signal (seen by the preemption flag's thread): one line says what happened and the process exits.
Nothing has been written at that point.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch.distributed as dist

from litsft.runtime.preemption import PreemptionFlag

TIMEOUT_ENV = "LITSFT_RENDEZVOUS_TIMEOUT"
"""Seconds every process waits for the others to join before the run gives up (default 600)."""
DEFAULT_TIMEOUT_S = 600.0
TIMED_OUT_EXIT_CODE = 2


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else DEFAULT_TIMEOUT_S


class RendezvousWatch:
    """`with RendezvousWatch(flag, expected):` around the launch of a run of several processes.

    Until this process has joined the process group, a SIGTERM, SIGUSR1 or SIGINT, or `timeout_s()`
    seconds without the others, end it through `flag.exit_at_once` (128 + the signal's number, or 2 on a
    timeout). `expected` names what the process waits for, for the message.
    """

    def __init__(self, flag: PreemptionFlag, expected: str) -> None:
        self.flag, self.expected = flag, expected
        self.timeout_s = timeout_s()
        self._done = threading.Event()

    def __enter__(self) -> RendezvousWatch:
        self.flag.listeners.append(self._on_signal)
        threading.Thread(target=self._watch, name="litsft-rendezvous", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._stop_listening()

    def _stop_listening(self) -> None:
        if self._on_signal in self.flag.listeners:
            self.flag.listeners.remove(self._on_signal)

    def _on_signal(self, signum: int) -> None:
        if not dist.is_initialized():
            name = signal.Signals(signum).name
            self.flag.exit_at_once(
                f"Stopped by {name} while {self.expected}; nothing was written", 128 + signum
            )

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._done.wait(0.2):
            if dist.is_initialized():
                self._stop_listening()
                return
            if time.monotonic() > deadline:
                break
        else:
            return
        self.flag.exit_at_once(
            f"error: gave up after {self.timeout_s:g} s {self.expected}; start the same command on every "
            f"node, or set {TIMEOUT_ENV} (seconds) to wait longer",
            TIMED_OUT_EXIT_CODE,
        )
