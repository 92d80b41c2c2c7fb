"""Reading SFT records from .json / .jsonl files, checked line by line.

Two record shapes are accepted, and both become a conversation (a list of messages):
- instruction records: {"instruction": str, "input": str (optional), "output": str, "system": str (optional)}
- conversation records: {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}

Every problem is a LitsftError naming the file, the line and the fix, raised before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from litsft.data.chat import Message
from litsft.errors import LitsftError

ROLES = ("system", "user", "assistant")
EXTENSIONS = (".json", ".jsonl")


class Conversations(list):
    """Conversations read from a file, each remembering the line its record starts on."""

    def __init__(self, conversations: list[list[Message]], path: Path, lines: list[int]) -> None:
        super().__init__(conversations)
        self.path, self.lines = path, lines

    def where(self, index: int) -> str:
        """The file and line of conversation `index`, for error messages."""
        return f"{self.path} line {self.lines[index]} (record {index + 1})"


def read_conversations(path: Path) -> Conversations:
    """All records of a .json (a list of records) or .jsonl (one record per line) file, as conversations."""
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
    records = _records_of_jsonl(path, text) if path.suffix == ".jsonl" else _records_of_json(path, text)
    if not records:
        raise LitsftError(f"{path} holds no records; add at least one record")
    conversations = [to_conversation(record, path, line) for line, record in records]
    return Conversations(conversations, path, [line for line, _ in records])


def to_conversation(record: Any, path: Path | str = "<records>", line: int = 0) -> list[Message]:
    """One record as a conversation; an instruction record becomes a single user/assistant exchange."""
    where = f"{path} line {line}"
    if not isinstance(record, dict):
        raise LitsftError(f"{where}: a record must be a JSON object, got {_type_name(record)}; {_SHAPES}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise LitsftError(
                f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, "
                f"got {_type_name(messages)}"
            )
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise LitsftError(
                    f"{where}: messages[{i}] must be an object with 'role' and 'content', got {_type_name(message)}"
                )
            for key in ("role", "content"):
                if key not in message:
                    raise LitsftError(
                        f"{where}: messages[{i}] has no {key!r}; every message needs 'role' and 'content'"
                    )
                if not isinstance(message[key], str):
                    raise LitsftError(
                        f"{where}: messages[{i}].{key} is {_type_name(message[key])}, expected a string"
                    )
            if message["role"] not in ROLES:
                raise LitsftError(
                    f"{where}: messages[{i}].role is {message['role']!r}; use one of {', '.join(ROLES)}"
                )
            conversation.append({"role": message["role"], "content": message["content"]})
        if not any(message["role"] == "assistant" for message in conversation):
            raise LitsftError(
                f"{where}: the conversation has no assistant message; add the reply to train on"
            )
        return conversation
    if "instruction" not in record or "output" not in record:
        missing = "instruction" if "instruction" not in record else "output"
        raise LitsftError(f"{where}: the record has no {missing!r}; {_SHAPES}")
    for key in ("instruction", "input", "output", "system"):
        if key in record and not isinstance(record[key], str):
            raise LitsftError(f"{where}: {key!r} is {_type_name(record[key])}, expected a string")
    prompt = record["instruction"]
    if record.get("input"):
        prompt = f"{prompt}\n\n{record['input']}"
    conversation = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    conversation += [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    return conversation


_SHAPES = "each record needs 'instruction' and 'output' (and optionally 'input'), or 'messages'"


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a number ({value})" if isinstance(value, int | float) else type(value).__name__
    )


def _records_of_jsonl(path: Path, text: str) -> list[tuple[int, Any]]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
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


def _records_of_json(path: Path, text: str) -> list[tuple[int, Any]]:
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
