"""Stopping a run on a signal. SIGTERM, SIGUSR1 (SLURM's warning before the time limit) and Ctrl-C (SIGINT)
make every rank finish its step, write a checkpoint and exit with PREEMPTED_EXIT_CODE; a second Ctrl-C
stops every process at once: without that checkpoint (exit 130), or, once it is published, with it (124).

Signals are read by a thread from Python's wakeup file descriptor, which the interpreter's C-level handler
writes even while the main thread is blocked in C++ (a collective waiting for another rank, the
rendezvous): the flag is set, and a second Ctrl-C acts, without waiting for the main thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar

PREEMPTED_EXIT_CODE = 124
"""Exit status after a SIGTERM/SIGUSR1/SIGINT stop with a checkpoint written: relaunch the same command to
resume (e.g. `scontrol requeue` in a SLURM script when the status is 124)."""
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
"""Exit status after a second Ctrl-C (the shell's code for a process ended by SIGINT)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionFlag:
    """Set by SIGTERM, SIGUSR1 or SIGINT; checked once per step on all ranks.

    The flag is all-reduced (max), so a signal that reaches any one process stops every rank after the same
    step: `kill <launcher pid>` reaches only Fabric's launcher (rank 0), SLURM signals every task, torchrun
    forwards SIGTERM to every worker and kills them 30 s later, a terminal's Ctrl-C reaches every process of
    the foreground job. One flag per process, installed by `launch` before anything slow, so a signal during
    setup stops the run after its first step instead of killing it.
    """

    _installed: ClassVar[PreemptionFlag | None] = None

    def __init__(self) -> None:
        self._received = False
        self._interrupted = False
        self._group: Any = None
        self.report = True
        """Whether this process prints the notices (one process of a run does)."""
        self.before_exit: Callable[[], None] = lambda: None
        """Run before this process ends at once (stop the ranks it spawned, free the out_dir lock)."""
        self.listeners: list[Callable[[int], None]] = []
        """Called from the watching thread with each signal's number (the rendezvous watch uses it)."""
        self.finish_stopped_run: Callable[[], None] | None = None
        """Set once the checkpoint a stop wrote is published (`checkpoint_published`): what is left to do
        (the loss plot) before a second Ctrl-C ends the process, which then loses no step."""
        self.stopped_exit_code = PREEMPTED_EXIT_CODE
        """This process's exit status once a stop's checkpoint is published. 0 in a rank that Fabric's
        launcher spawned: the launcher reports the stop, and a non-zero exit would make Fabric's child
        observer SIGKILL the launcher before it does."""
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="litsft-signals", daemon=True).start()

    @classmethod
    def install(cls) -> PreemptionFlag:
        if cls._installed is None:
            cls._installed = cls()
        return cls._installed

    @classmethod
    def uninstall(cls) -> None:
        """Give the signals back to the handlers they had (for runs inside another program, e.g. tests)."""
        flag, cls._installed = cls._installed, None
        if flag is not None:
            for sig, handler in flag._previous.items():
                signal.signal(sig, handler)
            os.close(signal.set_wakeup_fd(flag._previous_wakeup_fd))  # ends the watching thread's read

    def _handle(self, signum: int, frame: Any) -> None:
        self._received = True  # also set by the thread; this handler replaces KeyboardInterrupt

    def _watch(self) -> None:
        while signals := _read(self._read_fd):
            for signum in signals:
                if signum in STOP_SIGNALS:
                    self._on_signal(signum)
        os.close(self._read_fd)

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGINT:
            if self._interrupted and self.finish_stopped_run is not None:
                try:
                    self.finish_stopped_run()
                finally:
                    self.exit_at_once(
                        "Stopped at once by a second Ctrl-C after the checkpoint was written: no step is lost; "
                        "relaunch the same command to resume from it",
                        self.stopped_exit_code,
                    )
            if self._interrupted:
                self.exit_at_once(
                    "Stopped at once by a second Ctrl-C: the steps since the last checkpoint are lost; "
                    "relaunch the same command to resume from it",
                    INTERRUPTED_EXIT_CODE,
                )
            self._interrupted = True
            self.say("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: stop at once)")
        self._received = True
        for listener in self.listeners:
            listener(signum)

    def checkpoint_published(self, finish: Callable[[], None]) -> None:
        """The checkpoint of a stop is published: from now on a second Ctrl-C runs `finish` and exits with
        PREEMPTED_EXIT_CODE, as the stop itself would."""
        self.finish_stopped_run = finish

    def ignore_ctrl_c_while_exiting(self) -> None:
        """For a process on its way out after a stop's checkpoint: a second Ctrl-C must not end it by SIGINT
        (exit status -2) while Python finalizes, which gives the default handler back to every signal a Python
        handler had; an ignored signal is left ignored."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def say(self, line: str) -> None:
        if self.report:
            print(line, file=sys.stderr, flush=True)

    def exit_at_once(self, line: str, code: int) -> None:
        """End this process now, from any thread, without unwinding (no traceback, no waiting on the main
        thread): `before_exit` runs, then one line is printed."""
        try:
            self.before_exit()
        finally:
            self.say(line)
            os._exit(code)

    @property
    def received(self) -> bool:
        """Whether this process got the signal (`is_set` tells whether any rank did)."""
        return self._received

    def is_set(self, fabric: Any) -> bool:
        """Whether any rank got the signal (collective: every rank calls it after the same step)."""
        if fabric.world_size == 1:
            return self._received  # nothing to agree on
        # torch is imported here, not at the top: launch installs the flag before the run's checks, which
        # answer a bad command line without torch.
        import torch

        # A CPU tensor over gloo: the ranks agree without waiting for their GPUs to finish the step.
        if self._group is None:
            cpu_backend = torch.distributed.get_backend() == "gloo"
            self._group = (
                torch.distributed.group.WORLD if cpu_backend else torch.distributed.new_group(backend="gloo")
            )
        flag = torch.tensor(float(self._received))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


def _read(fd: int) -> bytes:
    """The signal numbers written since the last read; empty once the pipe's write end is closed."""
    try:
        return os.read(fd, 64)
    except OSError:
        return b""
