"""litsft/runtime/timings.py: each phase's wall time is the time since the previous mark, and the report adds them up;
each mark records the process's peak resident memory so far.
(A whole run's report is checked in tests/test_training_engine.py, on the run that checks its notices.)"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from litsft.runtime.timings import PhaseTimer, peak_rss_bytes


def test_each_phase_lasts_from_the_previous_mark_and_the_report_adds_them_up() -> None:
    timer = PhaseTimer()
    time.sleep(0.05)
    before = peak_rss_bytes()
    timer.mark("first")
    time.sleep(0.15)
    timer.mark("second phase")
    (first, a, first_rss), (second, b, second_rss) = timer.phases
    assert (first, second) == ("first", "second phase")
    assert a >= 0.05 and b >= 0.15
    lines = timer.report().splitlines()
    total = float(re.search(r"([\d.]+) s in all", lines[0]).group(1))
    assert total == pytest.approx(a + b, abs=0.05)  # printed to 0.1 s
    assert before <= first_rss <= second_rss <= peak_rss_bytes()
    rss = f"{first_rss / 2**20:,.0f}"
    assert re.fullmatch(rf"  first\s+{a:.2f} s\s+{a / (a + b):.1%}\s+{rss} MiB peak RSS", lines[1])
    assert lines[2].startswith("  second phase ")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux's /proc")
def test_the_peak_is_the_processs_own_not_the_one_of_the_process_that_launched_it() -> None:
    """getrusage's ru_maxrss keeps the peak of the image a process replaced when it started: every run
    launched from a process that had used more (a benchmark, a notebook) reported that process's peak."""
    used = b"\x01" * 256 * 2**20  # this process's peak now exceeds 256 MiB
    del used
    code = "from litsft.runtime.timings import peak_rss_bytes; print(peak_rss_bytes())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(child.stdout) < 128 * 2**20 <= 2 * 128 * 2**20 <= peak_rss_bytes()
