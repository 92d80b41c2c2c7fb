"""How much memory the machine can still give: what deciding to keep a copy of the training state in host
memory (a background checkpoint's staging buffers) needs to know. Plain files, no torch.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_host_memory(meminfo: Path = MEMINFO) -> int | None:
    """Bytes the kernel estimates can be allocated without swapping (Linux's MemAvailable, which counts the
    page cache it can drop: https://man7.org/linux/man-pages/man5/proc_meminfo.5.html); None where it does
    not say (another system, an older kernel)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            kib, *_ = value.split()
            return int(kib) * 1024
    return None
