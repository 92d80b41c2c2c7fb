"""Records to conversations: the record shapes litsft reads, detected per record or set by a flag, and
reading .json / .jsonl files checked line by line.

The shapes (`--data.record_shape`, default "auto": detected per record from the fields it has):
- "messages": {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str, ...}, ...],
  "tools": [JSON schema, ...] (optional)}, OpenAI style. Assistant messages may carry `tool_calls` and a
  reasoning field (`reasoning_content`, `thinking` or `reasoning`); tool messages `name` / `tool_call_id`.
  These are handed to the chat template as transformers' `apply_chat_template` hands them (the reasoning
  under each of its names).
- "sharegpt": {"conversations": [{"from": "human" | "gpt" | "system" | "tool" | ..., "value": str}, ...]}
  (FastChat / Vicuna, Infinity-Instruct). Roles are mapped by SHAREGPT_ROLES plus `--data.role_map`, and
  the message keys by `--data.message_map` (default {"role": "from", "content": "value"}).
- "alpaca": {"instruction", "input" (optional), "output", "system" (optional)}: one user/assistant exchange.
- "prompt_completion": {"prompt", "completion"}, each a string or a list of messages (TRL's shape).
- "text": {"text": str}: plain text, trained on every token without a template (pretraining data).

`--data.field_map` renames a dataset's fields to these names, e.g. {"instruction": "question", "output":
"answer"}. Every problem is a LitsftError naming where the record is (file and line, or dataset and row),
raised before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from litsft.data.chat import TEXT_ROLE, Conversation, Message
from litsft.errors import LitsftError

ROLES = ("system", "user", "assistant", "tool")
EXTENSIONS = (".json", ".jsonl")
RecordShape = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text"]

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
"""ShareGPT `from` values and the roles they become (FastChat's conversation format, and the tool roles of
function-calling ShareGPT sets)."""
SHAREGPT_MESSAGE = {"role": "from", "content": "value"}
# Message keys kept besides role and content: what chat templates read for tool use and reasoning.
EXTRA_MESSAGE_KEYS = ("tool_calls", "reasoning_content", "thinking", "reasoning", "name", "tool_call_id")


@dataclass(frozen=True)
class RecordFormat:
    """The record options, resolved: what `to_conversation` reads."""

    shape: RecordShape = "auto"
    field_map: dict[str, str] = field(default_factory=dict)
    role_map: dict[str, str] = field(default_factory=dict)
    message_map: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role in self.role_map.values():
            if role not in ROLES:
                raise LitsftError(
                    f"--data.role_map maps to {role!r}; map each name to one of {', '.join(ROLES)}"
                )
        for key in self.message_map:
            if key not in SHAREGPT_MESSAGE:
                raise LitsftError(f"--data.message_map has {key!r}; its keys are 'role' and 'content'")

    @property
    def is_default(self) -> bool:
        return self == RecordFormat()

    def identity(self) -> dict[str, Any]:
        """What changes the conversations read from the same records, for cache keys."""
        return {
            "shape": self.shape,
            "field_map": self.field_map,
            "role_map": self.role_map,
            "message_map": self.message_map,
        }


DEFAULT_FORMAT = RecordFormat()


class Conversations(list):
    """Conversations read from a file, each remembering the line its record starts on."""

    def __init__(self, conversations: list[list[Message]], path: Path, lines: list[int]) -> None:
        super().__init__(conversations)
        self.path, self.lines = path, lines

    def where(self, index: int) -> str:
        """The file and line of conversation `index`, for error messages."""
        return f"{self.path} line {self.lines[index]} (record {index + 1})"


def read_conversations(path: Path, record_format: RecordFormat = DEFAULT_FORMAT) -> Conversations:
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
    conversations = [
        to_conversation(record, f"{path} line {line}", record_format) for line, record in records
    ]
    return Conversations(conversations, path, [line for line, _ in records])


def to_conversation(
    record: Any, where: str = "record", record_format: RecordFormat = DEFAULT_FORMAT
) -> Conversation:
    """One record as a conversation (see the module docstring for the shapes)."""
    if not isinstance(record, dict):
        raise LitsftError(f"{where}: a record must be a JSON object, got {_type_name(record)}; {_SHAPES}")
    if record_format.field_map:
        record = {**record, **{name: record.get(source) for name, source in record_format.field_map.items()}}
    shape = record_format.shape if record_format.shape != "auto" else _detect_shape(record, where)
    tools = _tools(record.get("tools"), where)
    if shape == "text":
        text = _string(record, "text", where)
        return Conversation([{"role": TEXT_ROLE, "content": text}])
    if shape == "alpaca":
        conversation = _alpaca(record, where)
    elif shape == "prompt_completion":
        conversation = _part(record, "prompt", "user", where) + _part(
            record, "completion", "assistant", where
        )
    elif shape == "sharegpt":
        conversation = _messages(record, "conversations", where, record_format)
    else:
        conversation = _messages(record, "messages", where, None)
    if not any(message["role"] == "assistant" for message in conversation):
        raise LitsftError(f"{where}: the conversation has no assistant message; add the reply to train on")
    return Conversation(conversation, tools)


_SHAPES = (
    "each record needs 'messages', 'conversations' (ShareGPT), 'instruction' and 'output' (and optionally "
    "'input'), 'prompt' and 'completion', or 'text'; --data.field_map maps other field names"
)


def _detect_shape(record: dict, where: str) -> RecordShape:
    present = {key for key, value in record.items() if value is not None}
    if "messages" in present:
        return "messages"
    if "conversations" in present:
        return "sharegpt"
    if "instruction" in present or "output" in present:
        return "alpaca"
    if "prompt" in present and "completion" in present:
        return "prompt_completion"
    if "text" in present:
        return "text"
    fields = ", ".join(repr(key) for key in sorted(present)) or "none"
    raise LitsftError(f"{where}: the record fits no record shape (its fields: {fields}); {_SHAPES}")


def _alpaca(record: dict, where: str) -> list[Message]:
    for key in ("instruction", "output"):
        if record.get(key) is None:
            raise LitsftError(f"{where}: the record has no {key!r}; {_SHAPES}")
    for key in ("instruction", "input", "output", "system"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise LitsftError(f"{where}: {key!r} is {_type_name(record[key])}, expected a string")
    prompt = record["instruction"]
    if record.get("input"):
        prompt = f"{prompt}\n\n{record['input']}"
    conversation = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    return conversation + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": record["output"]},
    ]


def _part(record: dict, key: str, role: str, where: str) -> list[Message]:
    """A prompt or completion: a string (one message of `role`) or a list of messages."""
    value = record.get(key)
    if isinstance(value, list):
        return _messages({key: value}, key, where, None)
    return [{"role": role, "content": _string(record, key, where)}]


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if value is None:
        raise LitsftError(f"{where}: the record has no {key!r}; {_SHAPES}")
    if not isinstance(value, str):
        raise LitsftError(f"{where}: {key!r} is {_type_name(value)}, expected a string")
    return value


def _messages(record: dict, key: str, where: str, sharegpt: RecordFormat | None) -> list[Message]:
    """The messages under `key`, checked; ShareGPT messages (when `sharegpt` is given) with keys and
    roles mapped."""
    messages = record.get(key)
    if not isinstance(messages, list) or not messages:
        raise LitsftError(
            f"{where}: {key!r} must be a non-empty list of {{role, content}} objects, got {_type_name(messages)}"
        )
    keys = {"role": "role", "content": "content"}
    roles = {role: role for role in ROLES}
    if sharegpt is not None and any(isinstance(m, dict) and "role" not in m for m in messages):
        keys = {**SHAREGPT_MESSAGE, **sharegpt.message_map}
        roles = {**SHAREGPT_ROLES, **sharegpt.role_map}
    elif sharegpt is not None:
        roles.update(sharegpt.role_map)
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise LitsftError(
                f"{where}: {key}[{i}] must be an object with {keys['role']!r} and {keys['content']!r}, "
                f"got {_type_name(message)}"
            )
        role = message.get(keys["role"])
        if role is None:
            raise LitsftError(
                f"{where}: {key}[{i}] has no {keys['role']!r}; every message needs "
                f"{keys['role']!r} and {keys['content']!r}"
            )
        if role not in roles:
            mapped = "; map it with --data.role_map" if sharegpt is not None else ""
            raise LitsftError(
                f"{where}: {key}[{i}].{keys['role']} is {role!r}; use one of {', '.join(roles)}{mapped}"
            )
        converted = {"role": roles[role]}
        content = message.get(keys["content"])
        has_calls = bool(message.get("tool_calls"))
        if content is None and not has_calls:
            raise LitsftError(
                f"{where}: {key}[{i}] has no {keys['content']!r}; every message needs "
                f"{keys['role']!r} and {keys['content']!r}"
            )
        if content is not None and not isinstance(content, str):
            raise LitsftError(
                f"{where}: {key}[{i}].{keys['content']} is {_type_name(content)}, expected a string"
            )
        converted["content"] = content
        for extra in EXTRA_MESSAGE_KEYS:
            if message.get(extra) is not None:
                converted[extra] = _without_none(message[extra])
        if has_calls and not isinstance(converted["tool_calls"], list):
            raise LitsftError(
                f"{where}: {key}[{i}].tool_calls is {_type_name(message['tool_calls'])}, expected a list"
            )
        conversation.append(converted)
    return conversation


def _tools(tools: Any, where: str) -> list[dict] | None:
    """A record's tool schemas: a list of objects, or that list as a JSON string (as columnar files store it)."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise LitsftError(
                f"{where}: 'tools' is a string but not JSON ({err.msg}); store a list of schemas"
            ) from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise LitsftError(f"{where}: 'tools' is {_type_name(tools)}, expected a list of JSON schemas")
    return [_without_none(tool) for tool in tools] or None


def _without_none(value: Any) -> Any:
    """Drop None values from nested objects: columnar formats (parquet, arrow) fill the fields one record
    lacks with null, which JSON records never had and templates would print."""
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


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
