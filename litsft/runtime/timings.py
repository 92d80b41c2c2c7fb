"""Wall time of the phases of a run on this process, and its peak resident memory as each phase ended
(which phase set the peak: loading the model or training), printed at its end with `--log.timings true`.

The clock starts when this module is first imported, which `litsft.__main__` does with its first imports,
so the phases add up to the command's wall time from then on (the interpreter's own start, some tens of
milliseconds, comes before). Each `mark(phase)` ends a phase. Standard library only: it is imported
before anything heavy, and timing the heavy imports is part of its job.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path


def peak_rss_bytes() -> int:
    """The process's peak resident memory since it started.

    On Linux, the high-water mark of its own memory (VmHWM in /proc/self/status), not getrusage's ru_maxrss,
    which also keeps the peak of the image the process replaced when it started (`exec_mmap` in the kernel's
    fs/exec.c, https://github.com/torvalds/linux/blob/master/fs/exec.c): a run launched from a process that
    had used 600 MiB reports at least 600 MiB there. Elsewhere (macOS), ru_maxrss.
    """
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # in kB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


class PhaseTimer:
    """Phases in the order they ended, each with its wall time and the peak resident memory when it ended."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float, int]] = []
        """(phase, seconds, peak RSS in bytes when it ended)."""
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """End `phase` now: its wall time is the time since the previous mark, or since the timer started."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last, peak_rss_bytes()))
        self._last = now

    def report(self) -> str:
        """The phases, their seconds and their share of the total, one a line."""
        total = sum(seconds for _, seconds, _ in self.phases) or 1e-9
        width = max((len(phase) for phase, _, _ in self.phases), default=0)
        lines = [
            f"Wall time by phase, {total:.1f} s in all since the command started, and the process's peak "
            "resident memory (RSS) when each phase ended:"
        ]
        for phase, seconds, rss in self.phases:
            lines.append(
                f"  {phase:<{width}}  {seconds:7.2f} s  {seconds / total:6.1%}  {rss / 2**20:8,.0f} MiB peak RSS"
            )
        return "\n".join(lines)


run_timer = PhaseTimer()
"""This process's timer: the launcher and the engine mark the phases of the run on it."""
