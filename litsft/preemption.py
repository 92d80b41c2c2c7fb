"""Stopping a run cleanly on a signal: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) make every
rank finish its step, write a checkpoint and exit with PREEMPTED_EXIT_CODE."""

from __future__ import annotations

import signal
from typing import Any, ClassVar

import torch

PREEMPTED_EXIT_CODE = 124
"""Exit status after a SIGTERM/SIGUSR1 stop with a checkpoint written: relaunch the same command to resume
(e.g. `scontrol requeue` in a SLURM script when the status is 124)."""


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1; checked once per step on all ranks.

    The flag is all-reduced (max), so a signal that reaches any one process stops every rank after the same
    step: `kill <launcher pid>` reaches only Fabric's launcher (rank 0), SLURM signals every task, torchrun
    forwards SIGTERM to every worker and kills them 30 s later. One flag per process, installed by `launch`
    before anything slow, so a signal during setup stops the run after its first step instead of killing it.
    """

    _installed: ClassVar[PreemptionFlag | None] = None

    def __init__(self) -> None:
        self._received = False
        self._group: Any = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    @classmethod
    def install(cls) -> PreemptionFlag:
        if cls._installed is None:
            cls._installed = cls()
        return cls._installed

    def _handle(self, signum: int, frame: Any) -> None:
        self._received = True

    @property
    def received(self) -> bool:
        """Whether this process got the signal (`is_set` tells whether any rank did)."""
        return self._received

    def is_set(self, fabric: Any) -> bool:
        """Whether any rank got the signal (collective: every rank calls it after the same step)."""
        if fabric.world_size == 1:
            return self._received  # nothing to agree on
        # A CPU tensor over gloo: the ranks agree without waiting for their GPUs to finish the step.
        if self._group is None:
            cpu_backend = torch.distributed.get_backend() == "gloo"
            self._group = (
                torch.distributed.group.WORLD if cpu_backend else torch.distributed.new_group(backend="gloo")
            )
        flag = torch.tensor(float(self._received))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
