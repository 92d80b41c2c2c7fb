"""litsft/runtime/host_memory.py: the memory the machine can still give, from /proc/meminfo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from litsft.runtime.host_memory import available_host_memory

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   20480000 kB
Buffers:          100000 kB
"""


def test_available_memory_is_memavailable_in_bytes(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    assert available_host_memory(meminfo) == 20480000 * 1024


def test_a_system_that_does_not_say_gives_none(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_host_memory(meminfo) is None
    assert available_host_memory(tmp_path / "absent") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo is Linux's")
def test_this_machine_reports_a_plausible_figure() -> None:
    total_kib = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal:")).split()[1])
    available = available_host_memory()
    assert available is not None and 0 < available <= total_kib * 1024
