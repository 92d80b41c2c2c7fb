"""Reading .json / .jsonl record files a block at a time: every problem a LitsftError naming the file and line,
raised before anything is written, and memory holding a slice of the records, never the file.

`read_conversations(path)` is a `FileConversations`: one pass over the file, a block of READ_BLOCK_BYTES at a
time with a progress bar, reads and checks every record (as JSON and as a conversation, then lets it go) and
notes where every CHUNK_SIZE-th record starts (its byte offset and line). A slice of it (what a tokenizing
worker asks for: one chunk) then reads its own byte range from the record it starts at. A .jsonl file is read
line by line (each line one record); a .json file holds one list, whose elements are decoded one at a time by
`json.JSONDecoder.raw_decode` over a buffer of text that keeps what is not yet decoded. With a limit
(`read_conversations(path, limit=32)`, what `check` reads before launch) only the first records are read.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

import litsft.data.samples as samples
from litsft.data.chat import Message
from litsft.data.records import DEFAULT_FORMAT, RecordFormat, to_conversation
from litsft.errors import LitsftError
from litsft.runtime.files import json_problem

EXTENSIONS = (".json", ".jsonl")
READ_BLOCK_BYTES = 1 << 20
"""Bytes read from a file at a time; a record longer than that is read whole (the buffer grows to hold it)."""
CHECKED_PROGRESS_RECORDS = 1_000
"""The reading pass's progress bar is moved on every this many records (in bytes of the file)."""


class Conversations(list):
    """Conversations read from a file, each remembering the line its record starts on."""

    def __init__(self, conversations: list[list[Message]], path: Path, lines: list[int]) -> None:
        super().__init__(conversations)
        self.path, self.lines = path, lines

    def where(self, index: int) -> str:
        """The file and line of conversation `index`, for error messages."""
        return f"{self.path} line {self.lines[index]} (record {index + 1})"


def read_conversations(
    path: Path, record_format: RecordFormat = DEFAULT_FORMAT, limit: int | None = None
) -> Sequence[list[Message]]:
    """The records of a .json (a list of records) or .jsonl (one record per line) file, as conversations:
    all of them as a `FileConversations` (checked, then read a slice at a time); with `limit`, the first
    `limit` of them in a list (and only those are read)."""
    if limit is None:
        return FileConversations(Path(path), record_format)
    records = read_records(path, limit)
    conversations = [
        to_conversation(record, f"{path} line {line}", record_format) for line, record in records
    ]
    return Conversations(conversations, Path(path), [line for line, _ in records])


def read_records(path: Path, limit: int | None = None) -> list[tuple[int, Any]]:
    """(line, record) of each record of a .json or .jsonl file (the first `limit`), every problem a
    LitsftError naming the file and line."""
    with open(_checked(path), "rb") as file:
        return list(islice(_RecordReader(Path(path), file), limit))


def iter_records(path: Path, lines: bool | None = None) -> Iterator[tuple[int, Any]]:
    """(line, record) of each record of a .json or .jsonl file (`lines`: read as JSON Lines, whatever its
    name), read a block at a time, every problem a LitsftError naming the file and line."""
    path = Path(path)
    with open(path if lines is not None else _checked(path), "rb") as file:
        yield from _RecordReader(path, file, lines=path.suffix == ".jsonl" if lines is None else lines)


class FileConversations(Sequence):
    """The records of a .json / .jsonl file as conversations, read a slice at a time (see the module
    docstring). Creating one reads the whole file once, a block at a time, and checks every record; it
    pickles as the file's path and the starts of its chunks."""

    def __init__(self, path: Path, record_format: RecordFormat = DEFAULT_FORMAT) -> None:
        self.path, self.record_format = Path(path), record_format
        self.step = samples.CHUNK_SIZE  # a slice of one tokenizing chunk reads from one start
        self.starts: list[tuple[int, int, int]] = []
        """(byte offset, line, column) of records 0, step, 2 * step, ..."""
        self.length = 0
        self._lines: tuple[int, list[int]] = (0, [])
        self._check_and_index()

    def _check_and_index(self) -> None:
        size = _checked(self.path).stat().st_size
        bar = samples.progress_bar(size, f"Reading {self.path.name}", unit="B")
        try:
            with open(self.path, "rb") as file:
                reader = _RecordReader(self.path, file)
                shown = 0
                for line, record in reader:
                    if self.length % self.step == 0:
                        self.starts.append(reader.place())
                    to_conversation(record, f"{self.path} line {line}", self.record_format)  # checked
                    self.length += 1
                    if self.length % CHECKED_PROGRESS_RECORDS == 0:
                        shown = _moved(bar, shown, file.tell())
                _moved(bar, shown, size)
        finally:
            bar.close()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, int):
            if not -self.length <= index < self.length:
                raise IndexError(index)
            return self[index % self.length : index % self.length + 1][0]
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise IndexError("FileConversations slices with step 1 only")
        if start >= stop:
            return []
        # Read on from the chunk that holds `start`, from its byte offset: only its range of the file.
        chunk = start // self.step
        byte, line, column = self.starts[chunk]
        conversations, lines = [], []
        with open(self.path, "rb") as file:
            file.seek(byte)
            reader = _RecordReader(self.path, file, at=(byte, line, column))
            records = islice(reader, start - chunk * self.step, stop - chunk * self.step)
            for record_line, record in records:
                where = f"{self.path} line {record_line}"
                conversations.append(to_conversation(record, where, self.record_format))
                lines.append(record_line)
        self._lines = (start, lines)
        return conversations

    def where(self, index: int) -> str:
        """The file and line of conversation `index`, for error messages (the lines of the slice read last
        are kept: a tokenizing worker names the records of the chunk it has just read)."""
        first, lines = self._lines
        if not first <= index < first + len(lines):
            self[index : index + 1]
            first, lines = self._lines
        return f"{self.path} line {lines[index - first]} (record {index + 1})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_lines": (0, [])}


def _moved(bar: Any, shown: int, now: int) -> int:
    bar.update(now - shown)
    return now


def _checked(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise LitsftError(f"{path} does not exist; pass an existing .json or .jsonl file")
    if path.suffix not in EXTENSIONS:
        raise LitsftError(f"{path} has an unsupported extension; use a .json or .jsonl file")
    return path


class _Text:
    """A file's text from a byte offset on, decoded a block at a time into `text`, which keeps what is not
    yet consumed (`drop`); `byte`, `line` and `column` say where its first character is in the file."""

    def __init__(self, path: Path, file: BinaryIO, byte: int, line: int, column: int) -> None:
        self.path, self.file = path, file
        self.byte, self.line, self.column = byte, line, column
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text, self.ended = "", False
        self.ascii = True  # every character one byte: offsets in the text are offsets in the file
        self._counted = (0, line)  # newlines counted up to a position: lines are asked for in order

    def more(self, keep_from: int) -> int:
        """Drop the text before `keep_from` and read on (at least as much as is kept: a long record is read
        in growing steps, not decoded again for each block); returns where `keep_from` now is. False
        `self.ended` until the file has no more."""
        self.drop(keep_from)
        block = self.file.read(max(READ_BLOCK_BYTES, len(self.text)))
        try:
            decoded = self.decoder.decode(block, final=not block)
        except UnicodeDecodeError as err:
            # err.object is what the decoder held back from the block before (no newline) and this block.
            line = self.line + self.text.count("\n") + err.object.count(b"\n", 0, err.start)
            raise LitsftError(
                f"{self.path} line {line}: byte 0x{err.object[err.start]:02x} is not valid UTF-8; re-encode "
                "the file as UTF-8"
            ) from None
        if self.byte == 0 and not self.text and decoded.startswith("\ufeff"):
            decoded, self.byte = decoded[1:], 3  # a byte-order mark written by some editors
        self.ascii = self.ascii and decoded.isascii()
        self.text += decoded
        self.ended = not block
        return 0

    def drop(self, position: int) -> None:
        dropped = self.text[:position]
        self.byte += len(dropped) if self.ascii else len(dropped.encode())
        newline = dropped.rfind("\n")
        self.line += dropped.count("\n")
        self.column = position - newline if newline >= 0 else self.column + position
        self.text = self.text[position:]
        self._counted = (0, self.line)

    def line_at(self, position: int) -> int:
        """The line of `position`, counted on from the position asked for before."""
        counted, line = self._counted
        if position < counted:
            counted, line = 0, self.line
        line += self.text.count("\n", counted, position)
        self._counted = (position, line)
        return line

    def place(self, position: int) -> tuple[int, int, int]:
        """(byte offset, line, column) of `position`."""
        before = self.text[:position]
        newline = before.rfind("\n")
        return (
            self.byte + (len(before) if self.ascii else len(before.encode())),
            self.line_at(position),
            position - newline if newline >= 0 else self.column + position,
        )


_SPACE = re.compile(r"[ \t\n\r]*")


class _RecordReader:
    """(line, record) of each record of an open .json or .jsonl file, from its start or, with `at`, from the
    record starting at that (byte offset, line, column), which the file is positioned at. `place()` is where
    the record given last starts."""

    def __init__(
        self, path: Path, file: BinaryIO, at: tuple[int, int, int] | None = None, lines: bool | None = None
    ) -> None:
        self.path, self.file, self.at = path, file, at
        self.lines = path.suffix == ".jsonl" if lines is None else lines
        self.source = _Text(path, file, *(at or (0, 1, 1)))
        self.position = 0  # of the record given last, in the source's text

    def place(self) -> tuple[int, int, int]:
        return self.source.place(self.position)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self._lines() if self.lines else self._list()

    def fail(self, position: int, problem: str) -> LitsftError:
        return LitsftError(f"{self.path} line {self.source.line_at(position)}: {problem}")

    def _lines(self) -> Iterator[tuple[int, Any]]:
        """JSON Lines: each line that is not blank is one record."""
        source, start, found = self.source, 0, False
        while True:
            end = source.text.find("\n", start)
            if end < 0 and not source.ended:
                start = source.more(start)
                continue
            if end < 0:
                end = len(source.text)
                if start == end:
                    break
            text = source.text[start:end]
            if text.strip():
                found = True
                self.position = start
                line = source.line_at(start)
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as err:
                    raise LitsftError(
                        f"{self.path} line {line}: invalid JSON ({json_problem(err)}); each line of a .jsonl "
                        "file must be one complete JSON record"
                    ) from None
                yield line, record
            start = end + 1
            if start >= len(source.text) and source.ended:
                break
        if not found and self.at is None:
            raise LitsftError(f"{self.path} is empty; add at least one record")

    def _list(self) -> Iterator[tuple[int, Any]]:
        """The elements of a top-level JSON list, each with the line it starts on."""
        decoder, source = json.JSONDecoder(), self.source
        position = self._space(0)
        if self.at is None:
            if position >= len(source.text):
                raise LitsftError(f"{self.path} is empty; add at least one record")
            if source.text[position] != "[":
                raise self.fail(
                    position,
                    "a .json data file must hold a list of records ([{...}, ...]); use .jsonl for one record "
                    "per line",
                )
            position = self._space(position + 1)
        found = 0
        while position < len(source.text) and source.text[position] != "]":
            while True:
                try:
                    record, end = decoder.raw_decode(source.text, position)
                    if end < len(source.text) or source.ended:
                        break  # else a number may go on in the next block
                except json.JSONDecodeError as err:
                    if source.ended:
                        column = source.place(err.pos)[2]
                        raise self.fail(
                            err.pos,
                            f"invalid JSON ({json_problem(err, column)}); fix the record or remove it",
                        ) from None
                position = source.more(position)  # the record goes on past what is read
            self.position = position
            found += 1
            yield source.line_at(position), record
            position = self._space(end)
            if position < len(source.text) and source.text[position] == ",":
                position = self._space(position + 1)
            elif position >= len(source.text) or source.text[position] != "]":
                raise self.fail(
                    position, "invalid JSON (expected ',' or ']' after a record); fix the list syntax"
                )
        if position >= len(source.text):
            raise self.fail(
                len(source.text) - 1, "invalid JSON (the list is not closed with ']'); fix the list syntax"
            )
        after = position + 1
        while True:
            if source.text[after:].strip():
                raise self.fail(after, "invalid JSON (text after the closing ']'); remove it")
            if source.ended:
                break
            after = source.more(len(source.text))
        if not found and self.at is None:
            raise LitsftError(f"{self.path} holds no records; add at least one record")

    def _space(self, position: int) -> int:
        """The first position at or after `position` that is not JSON whitespace, reading on as needed;
        the text's length at the end of the file."""
        source = self.source
        while True:
            position = _SPACE.match(source.text, position).end()
            if position < len(source.text) or source.ended:
                return position
            position = source.more(position)
