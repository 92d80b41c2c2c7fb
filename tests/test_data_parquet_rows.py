"""litsft/data/parquet_rows.py: slices of parquet files read a batch at a time equal a plain pyarrow read of
the same rows (across row groups and files, in increasing order from a kept place, after going back, in
forkserver workers); only the selected columns are decoded; a broken file is named in one line."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_datasets import damage_a_page

from litsft.data import parquet_rows
from litsft.data.parquet_rows import ParquetRows, file_identity
from litsft.errors import LitsftError


def rows_of(count: int, first: int = 0) -> list[dict]:
    return [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}],
        }
        for i in range(first, first + count)
    ]


def write_parquet(path, rows: list[dict], row_group_size: int) -> str:
    table = pa.Table.from_pylist(rows or rows_of(1)).slice(0, len(rows))  # an empty file keeps the columns
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


@pytest.fixture
def files(tmp_path):
    """Three files of 23, 0 and 17 rows, in row groups of 5 and 7 rows: 40 rows in all."""
    return [
        write_parquet(tmp_path / "a.parquet", rows_of(23), row_group_size=5),
        write_parquet(tmp_path / "empty.parquet", rows_of(0), row_group_size=5),
        write_parquet(tmp_path / "b.parquet", rows_of(17, first=23), row_group_size=7),
    ]


def plain(files: list[str], columns: list[str]) -> dict[str, list]:
    """The same rows read whole by pyarrow, file after file: the reference."""
    tables = [pq.read_table(file, columns=columns) for file in files]
    return {
        column: [value for table in tables for value in table.column(column).to_pylist()]
        for column in columns
    }


def sliced(expected: dict[str, list], start: int, stop: int) -> dict[str, list]:
    return {column: values[start:stop] for column, values in expected.items()}


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(parquet_rows, "BATCH_ROWS", 3)


def test_slices_across_row_groups_and_files_equal_a_plain_read(files, small_batches):
    rows = ParquetRows(files)
    assert (rows.num_rows, rows.column_names) == (40, ["id", "conversations"])
    expected = plain(files, rows.column_names)
    for start, stop in [(0, 40), (3, 12), (20, 30), (22, 24), (39, 40), (10, 10), (35, 99)]:
        assert rows[start:stop] == sliced(expected, start, stop), (start, stop)


def test_increasing_chunks_read_on_from_the_kept_place_and_going_back_starts_again(
    files, small_batches, monkeypatch
):
    starts = []
    start_at = ParquetRows._start_at
    monkeypatch.setattr(
        ParquetRows,
        "_start_at",
        lambda self, file, row: starts.append((file, row)) or start_at(self, file, row),
    )
    rows = ParquetRows(files)
    expected = plain(files, rows.column_names)
    # A worker's chunks, increasing: contiguous ones read on; one skipping past its row group starts at the
    # row group holding its first row (a.parquet's groups start at 0, 5, 10, 15, 20; b.parquet's at 0, 7, 14).
    for start, stop in [(0, 4), (4, 6), (6, 8), (17, 19), (19, 25), (25, 28), (38, 40)]:
        assert rows[start:stop] == sliced(expected, start, stop), (start, stop)
    assert starts == [(0, 0), (0, 17), (2, 0), (2, 15)]
    starts.clear()
    # Going back: the row group holding the first row, read on from there.
    assert rows[12:24] == sliced(expected, 12, 24)
    assert rows[1:2] == sliced(expected, 1, 2)
    assert starts == [(0, 12), (2, 0), (0, 1)]


def test_a_batch_holds_batch_rows_whatever_the_row_group_size(tmp_path, small_batches, monkeypatch):
    """One row group of 100 rows is decoded 3 rows at a time: a slice of 4 rows at row 50 decodes at most
    the 54 rows up to it, never a batch of more than BATCH_ROWS."""
    path = write_parquet(tmp_path / "one_group.parquet", rows_of(100), row_group_size=100)
    rows = ParquetRows([path])
    decoded = []
    start_at = ParquetRows._start_at

    def recording_start_at(self, file, row):
        place = start_at(self, file, row)
        place.batches = (decoded.append(batch.num_rows) or batch for batch in place.batches)
        return place

    monkeypatch.setattr(ParquetRows, "_start_at", recording_start_at)
    assert rows[50:54] == sliced(plain([path], rows.column_names), 50, 54)
    assert max(decoded) == 3 and sum(decoded) <= 54 + 3


def test_only_the_selected_columns_are_decoded(files):
    rows = ParquetRows(files).select_columns(["conversations"])
    assert rows.column_names == ["conversations"]
    assert list(rows[0:2]) == ["conversations"]
    batch = rows._read(0, 2)
    assert batch.schema.names == ["conversations"]


_ROWS = None


def _install(rows):
    global _ROWS
    _ROWS = rows


def _read_slice(args):
    start, stop = args
    values = _ROWS[start:stop]
    assert _ROWS._process == os.getpid()  # the files and place this process read from are its own
    return values


@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_rows_pickle_as_their_files_and_read_the_same_in_worker_processes(files, start_method):
    """Workers started from a server process get the rows pickled; forked ones inherit them, and open the
    files again rather than read on from their parent's place."""
    rows = ParquetRows(files).select_columns(["id"])
    rows[0:30]  # a place and open files: neither travels
    state = pickle.dumps(rows)
    assert len(state) < 1000 and b"q1" not in state
    expected = plain(files, ["id"])
    with multiprocessing.get_context(start_method).Pool(2, initializer=_install, initargs=(rows,)) as pool:
        parts = pool.map(_read_slice, [(start, start + 10) for start in range(30, -1, -10)])
    assert [value for part in reversed(parts) for value in part["id"]] == expected["id"]


def test_a_file_that_is_not_parquet_is_named_in_one_line(tmp_path, files):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(
        LitsftError, match=rf"^{broken} is not a readable parquet file \(.*\); write it again$"
    ):
        ParquetRows([files[0], str(broken)])
    empty = tmp_path / "zero.parquet"
    empty.touch()
    with pytest.raises(LitsftError) as error:
        ParquetRows([str(empty)])
    assert str(error.value) == f"{empty} is empty (0 bytes); remove it or write it again"


def test_a_damaged_page_is_named_with_its_file_and_row_group(tmp_path):
    """Pages that no longer decode name the file and the row group (also when the batch that failed began in
    the row group before it), and say to replace the file; the row groups after it still read."""
    path = write_parquet(tmp_path / "a.parquet", rows_of(3000), row_group_size=1000)
    expected = plain([path], ["conversations"])
    damage_a_page(path, row_group=1)
    rows = ParquetRows([path], ["conversations"])
    for start in (0, 1500):
        with pytest.raises(LitsftError) as error:
            rows[start : start + 1000]
        assert str(error.value).startswith(
            f"{path} is damaged: row group 1 (rows 1,000 to 1,999 of the file) does not decode ("
        )
        assert str(error.value).endswith("); download the file again or replace it")
    assert rows[2000:3000] == sliced(expected, 2000, 3000)


def test_files_of_a_split_without_a_column_are_refused_naming_the_file(tmp_path, files):
    other = write_parquet(tmp_path / "other.parquet", [{"text": "t"}], row_group_size=5)
    with pytest.raises(LitsftError) as error:
        ParquetRows([files[0], other])
    assert str(error.value) == (
        f"{other} has no column 'id', 'conversations', which {files[0]} has; every file of a split needs the "
        "same columns"
    )


def test_a_file_written_again_in_place_has_another_identity(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", rows_of(3), row_group_size=5)
    before = file_identity(path)
    assert file_identity(path) == before
    write_parquet(tmp_path / "rows.parquet", rows_of(3, first=1), row_group_size=5)
    os.utime(path, ns=(before["mtime_ns"] + 1_000_000, before["mtime_ns"] + 1_000_000))
    assert file_identity(path) != before
