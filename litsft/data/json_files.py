"""Reading .json / .jsonl record files, checked line by line: every problem a LitsftError naming the file and
line, raised before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from litsft.data.chat import Message
from litsft.data.records import DEFAULT_FORMAT, RecordFormat, to_conversation
from litsft.errors import LitsftError

EXTENSIONS = (".json", ".jsonl")


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
) -> Conversations:
    """All records of a .json (a list of records) or .jsonl (one record per line) file, as conversations;
    with `limit`, only the first `limit` of them (and only those are read past the file's first bytes)."""
    records = read_records(path, limit)
    conversations = [
        to_conversation(record, f"{path} line {line}", record_format) for line, record in records
    ]
    return Conversations(conversations, Path(path), [line for line, _ in records])


def read_records(path: Path, limit: int | None = None) -> list[tuple[int, Any]]:
    """(line, record) of each record of a .json or .jsonl file (the first `limit`), every problem a
    LitsftError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise LitsftError(f"{path} does not exist; pass an existing .json or .jsonl file")
    if path.suffix not in EXTENSIONS:
        raise LitsftError(f"{path} has an unsupported extension; use a .json or .jsonl file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise LitsftError(
            f"{path} line {line}: byte 0x{raw[err.start]:02x} is not valid UTF-8; re-encode the file as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")  # a byte-order mark written by some editors
    if not text.strip():
        raise LitsftError(f"{path} is empty; add at least one record")
    if path.suffix == ".jsonl":
        records = records_of_jsonl(path, text, limit)
    else:
        records = _records_of_json(path, text, limit)
    if not records:
        raise LitsftError(f"{path} holds no records; add at least one record")
    return records


def records_of_jsonl(path: Path, text: str, limit: int | None = None) -> list[tuple[int, Any]]:
    """(line, record) of each line of JSON Lines `text` read from `path` (the first `limit`)."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if len(records) == limit:
            break
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise LitsftError(
                f"{path} line {number}: invalid JSON ({err.msg} at column {err.colno}); "
                "each line of a .jsonl file must be one complete JSON record"
            ) from None
    return records


def _records_of_json(path: Path, text: str, limit: int | None) -> list[tuple[int, Any]]:
    """The elements of a top-level JSON list, each with the line it starts on."""
    decoder = json.JSONDecoder()

    def fail(position: int, problem: str) -> LitsftError:
        line = text.count("\n", 0, position) + 1
        return LitsftError(f"{path} line {line}: {problem}")

    position = _skip_space(text, 0)
    if text[position] != "[":
        raise fail(
            position,
            "a .json data file must hold a list of records ([{...}, ...]); use .jsonl for one record per line",
        )
    records, line, counted_to = [], 1, 0
    position = _skip_space(text, position + 1)
    while position < len(text) and text[position] != "]":
        if len(records) == limit:
            return records
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise fail(err.pos, f"invalid JSON ({err.msg}); fix the record or remove it") from None
        line += text.count("\n", counted_to, position)
        counted_to = position
        records.append((line, record))
        position = _skip_space(text, end)
        if position < len(text) and text[position] == ",":
            position = _skip_space(text, position + 1)
        elif position >= len(text) or text[position] != "]":
            raise fail(position, "invalid JSON (expected ',' or ']' after a record); fix the list syntax")
    if position >= len(text):
        raise fail(len(text) - 1, "invalid JSON (the list is not closed with ']'); fix the list syntax")
    if text[position + 1 :].strip():
        raise fail(position + 1, "invalid JSON (text after the closing ']'); remove it")
    return records


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position
