"""litsft/runtime/heap.py: freed temporary arrays that stay resident, and handing them back."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

from litsft.runtime.heap import release_freed_heap

# In a fresh process (this one's heap is whatever the earlier tests left): one large array freed raises
# glibc's mmap threshold, so the next arrays come from the heap; all but the last are freed, and the last
# keeps the heap from shrinking on its own. Anonymous resident memory before and after the release.
LEFT_BEHIND = """
import json, numpy as np
from litsft.runtime.heap import release_freed_heap

def anonymous_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

large = np.ones(30 << 20, np.uint8)
del large  # frees a 30 MB mapping: the threshold rises to 30 MB
arrays = [np.ones(4 << 20, np.uint8) for _ in range(10)]  # 40 MB from the heap
kept = arrays.pop()
del arrays
before = anonymous_mb()
released = release_freed_heap()
print(json.dumps({"before": before, "after": anonymous_mb(), "released": released}))
"""


def test_freed_heap_pages_go_back_to_the_system_on_glibc() -> None:
    result = json.loads(subprocess.run([sys.executable, "-c", LEFT_BEHIND], capture_output=True, text=True,
                                       check=True).stdout)  # fmt: skip
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert result["released"]
        assert result["before"] - result["after"] > 30  # of the 36 MB freed but resident
    else:
        assert not result["released"]


def test_releasing_twice_is_harmless() -> None:
    assert release_freed_heap() == release_freed_heap()
