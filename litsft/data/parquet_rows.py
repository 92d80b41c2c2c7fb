"""The rows of parquet files read straight with pyarrow, a bounded slice at a time: `ParquetRows`.

`ParquetRows(files)[start:stop]` is `{column: [values]}` for those rows of the files taken one after another,
as a `datasets.Dataset` slices (what `hf_dataset.DatasetConversations` reads). Only the selected columns are
decoded, BATCH_ROWS rows at a time, so memory holds one slice and one batch whatever the size of the files'
row groups (`buffer_size` bounds what is read of a column chunk at once). A process keeps its place in a
file between slices: tokenizing workers are handed increasing chunks, and a slice that starts at or after
the place reads on from it (skipping whole row groups without decoding them); one that starts before it, or
in another file, starts again from the row group that holds its first row.

A `ParquetRows` pickles as its file paths, columns and row counts (cheap to hand to a forkserver worker);
each process opens the files itself when it first reads them. Nothing of `datasets` is imported here.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litsft.errors import LitsftError
from litsft.runtime.files import first_line

BATCH_ROWS = 10_000
"""Rows decoded at a time (one tokenizing chunk, samples.CHUNK_SIZE)."""
READ_BUFFER_BYTES = 1 << 20
"""How much of a column chunk is read at a time: without it pyarrow reads a whole column chunk (a row
group's column, tens of MB for a row group of 1M conversations) before decoding its first page."""


def open_parquet(file: str) -> Any:
    """`pyarrow.parquet.ParquetFile` of `file`, or one line naming the file when it is not parquet."""
    import pyarrow.parquet

    if os.path.getsize(file) == 0:
        raise LitsftError(f"{file} is empty (0 bytes); remove it or write it again")
    try:
        return pyarrow.parquet.ParquetFile(file, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
    except Exception as err:
        raise LitsftError(
            f"{file} is not a readable parquet file ({first_line(err)}); write it again"
        ) from None


def file_identity(file: str) -> dict[str, Any]:
    """What changes when a local file is written again: its resolved path, size and modification time."""
    stat = os.stat(file)
    return {"path": str(Path(file).resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@dataclass
class _Place:
    """Where a process is in one file: the next row `row` (within the file) comes from `batches`, after
    what is left of the batch read last (`pending`)."""

    file: int
    row: int
    batches: Iterator[Any]
    pending: Any = None


class ParquetRows:
    """Rows of parquet `files`, one file after another, sliced as `datasets.Dataset` slices (see the module
    docstring). `num_rows` and `column_names` come from the files' footers, read once when created."""

    def __init__(self, files: list[str], columns: list[str] | None = None) -> None:
        self.files = list(files)
        footers = [open_parquet(file).metadata for file in self.files]
        names = footers[0].schema.to_arrow_schema().names if footers else []
        self.columns = list(names if columns is None else columns)
        self._all_columns = names
        self._file_rows = [footer.num_rows for footer in footers]
        for file, footer in zip(self.files, footers):
            missing = [c for c in self.columns if c not in footer.schema.to_arrow_schema().names]
            if missing:
                raise LitsftError(
                    f"{file} has no column {', '.join(map(repr, missing))}, which {self.files[0]} has; "
                    "every file of a split needs the same columns"
                )
        self._setup()

    def _setup(self) -> None:
        self._file_starts = [0, *itertools.accumulate(self._file_rows)]
        self._opened: dict[int, Any] = {}
        self._place: _Place | None = None
        self._process = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # Open files and the place in them stay with this process; another opens the files again.
        return {key: self.__dict__[key] for key in ("files", "columns", "_all_columns", "_file_rows")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    @property
    def num_rows(self) -> int:
        return self._file_starts[-1]

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def select_columns(self, columns: list[str]) -> ParquetRows:
        """These rows with only `columns` (in this order), as `datasets.Dataset.select_columns`."""
        selected = object.__new__(ParquetRows)
        selected.__setstate__({**self.__getstate__(), "columns": list(columns)})
        return selected

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: slice) -> dict[str, list[Any]]:
        """`{column: [values]}` of rows start..stop (step 1), read on from this process's place when it
        can."""
        if not isinstance(index, slice):
            raise TypeError("ParquetRows is read by slices: rows[start:stop]")
        start, stop, step = index.indices(self.num_rows)
        if step != 1:
            raise IndexError("ParquetRows slices with step 1 only")
        values: dict[str, list[Any]] = {column: [] for column in self.columns}
        row = start
        while row < stop:
            # Batch by batch: files of one split may differ in types that decode alike (string, large_string).
            batch = self._read(row, stop)
            for column in self.columns:
                values[column].extend(batch.column(column).to_pylist())
            row += batch.num_rows
        return values

    def _read(self, start: int, stop: int) -> Any:
        """A record batch of rows from `start` on (at least one, none past `stop` nor past its file's
        end), from this process's place in the file."""
        if self._process != os.getpid():  # a forked worker: the files and the place are its parent's
            self._setup()
        file = bisect.bisect_right(self._file_starts, start) - 1
        row, end = start - self._file_starts[file], min(stop, self._file_starts[file + 1])
        place = self._place
        if (
            place is None
            or place.file != file
            or place.row > row
            or self._row_group_holding(file, row)[1] > place.row
        ):
            place = self._place = self._start_at(file, row)
        while True:
            if place.pending is None or place.pending.num_rows == 0:
                place.pending = self._next_batch(place)
            batch = place.pending
            if place.row + batch.num_rows <= row:  # before the rows asked for: skipped
                place.row += batch.num_rows
                place.pending = None
                continue
            skip = row - place.row
            taken = batch.slice(skip, min(batch.num_rows - skip, end - self._file_starts[file] - row))
            place.pending = batch.slice(skip + taken.num_rows)
            place.row = row + taken.num_rows
            return taken

    def _next_batch(self, place: _Place) -> Any:
        """The next record batch at `place`; pages that do not decode (bytes overwritten or lost while the
        footer stayed intact) are one LitsftError naming the file and the row group."""
        import pyarrow

        try:
            return next(place.batches)
        except (OSError, pyarrow.ArrowException) as err:
            self._place = None  # the reader is broken: a later slice starts again from its row group
            raise LitsftError(
                f"{self.files[place.file]} is damaged: {self._damaged_rows(place)} does not decode "
                f"({first_line(err)}); download the file again or replace it"
            ) from None

    def _damaged_rows(self, place: _Place) -> str:
        """Which row group of the batch that failed at `place` does not decode, found by reading each alone
        (a batch of BATCH_ROWS rows spans the row groups smaller than it)."""
        import pyarrow

        opened, (group, first) = self._open(place.file), self._row_group_holding(place.file, place.row)
        while group < opened.metadata.num_row_groups and first < place.row + BATCH_ROWS:
            count = opened.metadata.row_group(group).num_rows
            try:
                opened.read_row_group(group, columns=self.columns, use_threads=False)
            except (OSError, pyarrow.ArrowException):
                return f"row group {group} (rows {first:,} to {first + count - 1:,} of the file)"
            group, first = group + 1, first + count
        return f"a row group holding rows {place.row:,} to {place.row + BATCH_ROWS - 1:,} of the file"

    def _row_group_holding(self, file: int, row: int) -> tuple[int, int]:
        """The row group of `file` that holds `row` (the group count past the last), and its first row
        within the file."""
        metadata, first = self._open(file).metadata, 0
        for group in range(metadata.num_row_groups):
            count = metadata.row_group(group).num_rows
            if row < first + count:
                return group, first
            first += count
        return metadata.num_row_groups, first

    def _start_at(self, file: int, row: int) -> _Place:
        """A place at the start of the row group of `file` that holds `row`."""
        group, first = self._row_group_holding(file, row)
        opened = self._open(file)
        batches = opened.iter_batches(
            batch_size=BATCH_ROWS,
            row_groups=list(range(group, opened.metadata.num_row_groups)),
            columns=self.columns,
            use_threads=False,
        )
        return _Place(file, first, iter(batches))

    def _open(self, file: int) -> Any:
        if file not in self._opened:
            self._opened = {file: open_parquet(self.files[file])}  # one file open at a time
        return self._opened[file]
