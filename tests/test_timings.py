"""litsft/timings.py: each phase's wall time is the time since the previous mark, and the report adds them up.
(A whole run's report is checked in tests/test_engine.py, on the run that checks its notices.)"""

from __future__ import annotations

import re
import time

import pytest

from litsft.timings import PhaseTimer


def test_each_phase_lasts_from_the_previous_mark_and_the_report_adds_them_up() -> None:
    timer = PhaseTimer()
    time.sleep(0.05)
    timer.mark("first")
    time.sleep(0.15)
    timer.mark("second phase")
    (first, a), (second, b) = timer.phases
    assert (first, second) == ("first", "second phase")
    assert a >= 0.05 and b >= 0.15
    lines = timer.report().splitlines()
    total = float(re.search(r"([\d.]+) s in all", lines[0]).group(1))
    assert total == pytest.approx(a + b, abs=0.05)  # printed to 0.1 s
    assert re.fullmatch(rf"  first\s+{a:.2f} s\s+{a / (a + b):.1%}", lines[1])
    assert lines[2].startswith("  second phase ")
