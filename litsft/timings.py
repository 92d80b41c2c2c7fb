"""Wall time of the phases of a run on this process, printed at its end with `--log.timings true`.

The clock starts when this module is first imported, which `litsft.__main__` does with its first imports,
so the phases add up to the command's wall time from then on (the interpreter's own start, some tens of
milliseconds, comes before). Each `mark(phase)` ends a phase. Standard library only: it is imported
before anything heavy, and timing the heavy imports is part of its job.
"""

from __future__ import annotations

import time


class PhaseTimer:
    """Phases in the order they ended, each with its wall time."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """End `phase` now: its wall time is the time since the previous mark, or since the timer started."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def report(self) -> str:
        """The phases, their seconds and their share of the total, one a line."""
        total = sum(seconds for _, seconds in self.phases) or 1e-9
        width = max((len(phase) for phase, _ in self.phases), default=0)
        lines = [f"Wall time by phase, {total:.1f} s in all since the command started:"]
        for phase, seconds in self.phases:
            lines.append(f"  {phase:<{width}}  {seconds:7.2f} s  {seconds / total:6.1%}")
        return "\n".join(lines)


run_timer = PhaseTimer()
"""This process's timer: the launcher and the engine mark the phases of the run on it."""
