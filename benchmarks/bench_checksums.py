"""What a step checkpoint's checksums cost, per GiB: hashing while a file is written, and reading a file back
to check it on resume; and the hashes litsft could have used, on the same bytes.

    python benchmarks/bench_checksums.py [--gib 1 --repeats 5] [--dir /tmp]

Each repeat writes GiB of random bytes plainly and through `runtime.files.write_bytes` (which hashes them as
it writes, XXH3-128), then checks the file as a resume does (`runtime.files.checksum_of_file`: read in 16 MiB
chunks and hashed; the file was just written, so it is read from the page cache: a cold read adds the disk's
time). Then XXH3-128, zlib's CRC-32 and hashlib's SHA-256 and BLAKE2b hash the same bytes in memory. Prints
medians in seconds per GiB. Asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import xxhash
from harness import machine_description

from litsft.runtime.files import checksum_of_file, write_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    data = os.urandom(int(args.gib * 2**30))
    path = args.dir / f"bench_checksums-{os.getpid()}.bin"
    hashes: dict[str, Callable[[], object]] = {
        "xxh3_128 (litsft)": lambda: xxhash.xxh3_128(data).hexdigest(),
        "crc32 (zlib)": lambda: zlib.crc32(data),
        "sha256 (hashlib)": lambda: hashlib.sha256(data).hexdigest(),
        "blake2b (hashlib)": lambda: hashlib.blake2b(data).hexdigest(),
    }
    times: dict[str, list[float]] = {}

    def timed(name: str, work: Callable[[], object]) -> None:
        start = time.perf_counter()
        work()
        times.setdefault(name, []).append((time.perf_counter() - start) / args.gib)

    try:
        for _ in range(args.repeats):
            timed("write", lambda: path.write_bytes(data))
            timed("write, hashed as written", lambda: write_bytes(path, data))
            timed("check on resume (read + hash)", lambda: checksum_of_file(path))
            for name, work in hashes.items():
                timed(f"hash in memory: {name}", work)
    finally:
        path.unlink(missing_ok=True)
    print(machine_description())
    print(f"{args.gib:g} GiB, {args.repeats} repeats, median seconds per GiB:")
    for name, values in times.items():
        print(f"  {name:<42} {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
