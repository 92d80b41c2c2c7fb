"""Plain files and directories, nothing torch: JSON read with a one-line error, durable writes, and
`publish_atomically`, the one way litsft makes an output directory appear complete or not at all.
Imported by the configuration, so it stays free of heavy imports.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash
from safetensors import SafetensorError

from litsft.errors import LitsftError


def first_line(err: BaseException) -> str:
    """The first line of an exception's text (library errors are often multi-line), or its type name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---- JSON and durable writes ---------------------------------------------------------------------------
def read_json(path: Path, fix: str = "restore it from the original checkpoint") -> Any:
    """The JSON value in `path`; a file that is not JSON is a LitsftError saying `fix`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LitsftError(f"{path} is not valid JSON ({err}); {fix}") from None


def json_problem(err: json.JSONDecodeError, column: int | None = None) -> str:
    """What is wrong, and at which column of its line: "Expecting value at column 32" (some of json's
    messages end with "at" already: "Unterminated string starting at column 5")."""
    column = err.colno if column is None else column
    return f"{err.msg} column {column}" if err.msg.endswith(" at") else f"{err.msg} at column {column}"


def write_json(path: Path, value: Any, durable: bool = False) -> None:
    """`value` as indented JSON; `durable` fsyncs it before returning (a checkpoint's last file)."""
    text = json.dumps(value, indent=2, default=_json_default) + "\n"
    write_bytes(path, text.encode("utf-8"), durable)


def write_bytes(path: Path, data: bytes, durable: bool = False) -> str:
    """Write `data` to `path` (`durable`: fsynced) and return its checksum (`checksum_of_file` reads the same)."""
    with ChecksummedFile(path) as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return f.checksum()


# ---- checksums -------------------------------------------------------------------------------------------
CHECKSUM_ALGORITHM = "xxh3_128"
"""The hash of a checkpoint's files. Not a cryptographic one: it guards against bit flips, bad copies and
overwritten files, not an adversary (who could rewrite the recorded checksums as well). XXH3 hashes several
times faster than zlib's CRC-32 or hashlib's SHA-256 and BLAKE2b (3.9 GiB/s against 1.05, 0.59 and 0.25 on this
repository's 2-core CPU), and 128 bits leave no chance of a damaged file matching by accident."""


class ChecksummedFile:
    """A file opened for writing that hashes every byte written to it, and names itself in the OSError of a
    write that fails (the kernel's ENOSPC carries no file name). Everything else is the file's own."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._hash = xxhash.xxh3_128()

    def write(self, data: Any) -> int:
        self._hash.update(data)
        try:
            return self._file.write(data)
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.path)) from None

    def checksum(self) -> str:
        """`<algorithm>:<hex digest>` of the bytes written so far."""
        return f"{CHECKSUM_ALGORITHM}:{self._hash.hexdigest()}"

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._file, name)

    def __enter__(self) -> ChecksummedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def checksum_of_file(path: Path, chunk_bytes: int = 16 * 2**20) -> str:
    """`<algorithm>:<hex digest>` of a file's bytes, read a chunk at a time."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


def readable_size(num_bytes: float) -> str:
    """Bytes in decimal units, three significant digits: "812 kB", "1.23 GB"."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(num_bytes) < 999.5:
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:,.3g} TB" if num_bytes < 999.5 else f"{num_bytes:,.0f} TB"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # a tensor or an array
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


# ---- publishing a directory ------------------------------------------------------------------------------
@contextmanager
def publish_atomically(
    target: Path,
    what: str,
    staging: Path | None = None,
    fix: str = "pass an --out_dir on a writable disk with free space",
) -> Iterator[Path]:
    """An empty staging directory next to `target` that becomes `target` with one rename when the block
    succeeds and is deleted when it fails, so `target` is complete or absent, never half-written.

    Refuses a `target` that exists and is not an empty directory. `staging` fixes the staging directory's
    name where several processes must agree on it (a leftover from a crash is removed first); by default
    it gets a fresh random name. A failure to write (a read-only place, a full disk) becomes one
    LitsftError naming `what` (e.g. "the converted checkpoint"), where, and `fix`.
    """
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise LitsftError(
            f"output directory {target} already exists and is not empty; choose another --out_dir or remove it"
        )
    # Not tempfile.mkdtemp: its 0700 permissions would become the output's.
    staging = staging or target.parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
    try:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        yield staging
        if target.exists():
            target.rmdir()  # empty, checked above
        staging.rename(target)
    except (OSError, SafetensorError) as err:
        raise LitsftError(f"cannot write {what} to {target} ({describe_os_error(err)}); {fix}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def describe_os_error(err: BaseException) -> str:
    """ "Permission denied: /x/y" for an OSError, the first line of anything else."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return first_line(err)


def make_readable_like_other_files(path: Path) -> None:
    """Give `path` the mode the umask gives a new file (0644 under the usual 022); safetensors writes 0600."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    # Linux reports it without changing it; setting and restoring it would race with other threads.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
