"""Fault injection for the crash tests: named points in the engine and checkpoint code where a test can
crash a run at an exact moment. Inert unless the environment variable LITSFT_FAULT_AT is set; never set it
outside tests.

    LITSFT_FAULT_AT=<point>[@<rank>][:<action>][,<another point and action>...]

`<point>` is a name passed to `fault_point`, e.g. `after_step_3`, `save_4_shards_written`,
`save_4_before_rename`, `final_before_rename` (grep for `fault_point(` to see them all). The fault fires
on global rank `<rank>` (default 0). Actions:
    kill    (default) SIGKILL the whole process group, like a node dying. The crash harness starts each run
            in a session of its own, so only the run's processes die.
    enospc  raise OSError(ENOSPC) there, like a full disk.
    pause=<file>  create <file>, then wait for a signal (a test sends SIGTERM at that exact moment).
    hold=<file>   create <file>, then hang until the process is killed (a step that never ends).
"""

from __future__ import annotations

import errno
import os
import signal
import time

FAULT_ENV = "LITSFT_FAULT_AT"


def fault_point(name: str, rank: int = 0) -> None:
    """Crash here if LITSFT_FAULT_AT names this point and this rank; do nothing otherwise."""
    specs = os.environ.get(FAULT_ENV)
    if not specs:
        return
    for spec in specs.split(","):
        target, _, action = spec.partition(":")
        point, _, target_rank = target.partition("@")
        if point == name and int(target_rank or 0) == rank:
            _fire(name, action)


def _fire(name: str, action: str) -> None:
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(fault injected at {name})")
    if action.startswith("pause="):
        from litsft.runtime.preemption import PreemptionFlag

        open(action.removeprefix("pause="), "w").close()
        flag = PreemptionFlag.install()
        while not flag.received:
            time.sleep(0.05)
        return
    if action.startswith("hold="):
        open(action.removeprefix("hold="), "w").close()
        while True:
            time.sleep(0.05)
    os.killpg(os.getpgrp(), signal.SIGKILL)
