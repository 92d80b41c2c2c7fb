"""Records to conversations: the record shapes litsft reads, detected per record or set by a flag (json_files.py
reads them from .json / .jsonl files).

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
- "preference": {"prompt" (optional), "chosen", "rejected"}: a prompt and two replies to it, the preferred and
  the rejected (TRL's preference shapes): strings (the prompt a user message, each reply an assistant one) or
  lists of messages; without a prompt, chosen and rejected are whole conversations and the prompt is the
  messages they share at their start (UltraFeedback-binarized). What preference objectives train on.
- "text": {"text": str}: plain text, trained on every token without a template (pretraining data).

The fields each shape reads are listed once, in SHAPE_FIELDS (detection, the columns a dataset decodes and
`check_columns` read it). `--data.field_map` renames a dataset's fields to these names, e.g.
{"instruction": "question", "output": "answer"}. Every problem is a LitsftError naming where the record is (file and line, or dataset and row),
raised before anything is written.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from litsft.data.chat import TEXT_ROLE, Conversation, Message, PreferencePair
from litsft.errors import LitsftError

ROLES = ("system", "user", "assistant", "tool")
RecordShape = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "preference", "text"]

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


@dataclass(frozen=True)
class ShapeFields:
    """The fields a record shape reads: those it needs, and those it reads when they are there."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


SHAPE_FIELDS: dict[str, ShapeFields] = {
    "messages": ShapeFields(("messages",)),
    "sharegpt": ShapeFields(("conversations",)),
    "alpaca": ShapeFields(("instruction", "output"), ("input", "system")),
    "prompt_completion": ShapeFields(("prompt", "completion")),
    "preference": ShapeFields(("chosen", "rejected"), ("prompt",)),
    "text": ShapeFields(("text",)),
}
"""The fields of each record shape, in the order shapes are detected (see `shape_of_fields`); every shape
also reads `tools` (COMMON_FIELDS). The one list of them: detection, the columns a dataset decodes
(hf_dataset.py) and the check of a dataset's columns all read it, so a new shape is one entry here."""
COMMON_FIELDS = ("tools",)


def record_fields() -> list[str]:
    """Every field some record shape reads."""
    fields = (name for shape in SHAPE_FIELDS.values() for name in shape.required + shape.optional)
    return list(dict.fromkeys([*fields, *COMMON_FIELDS]))


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
    if shape == "preference":
        return _preference(record, where, tools)
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


def shape_of_fields(present: set[str]) -> RecordShape | None:
    """The shape a record with these (non-null) fields is read as: the first of SHAPE_FIELDS whose required
    fields it has (for alpaca, either of them: a missing one is then named); None when it fits none."""
    for shape, fields in SHAPE_FIELDS.items():
        has = any if shape == "alpaca" else all
        if has(name in present for name in fields.required):
            return shape
    return None


def check_columns(columns: list[str], where: str, record_format: RecordFormat = DEFAULT_FORMAT) -> None:
    """Refuse, in one line naming them, a dataset's columns when no record shape can be read from them
    (after --data.field_map): every record would fail, or be read without the fields it was meant to give."""
    fields = {*columns, *(name for name, source in record_format.field_map.items() if source in columns)}
    if record_format.shape != "auto":
        fits = set(SHAPE_FIELDS[record_format.shape].required) <= fields
    else:
        fits = shape_of_fields(fields) is not None
    if not fits:
        named = ", ".join(repr(column) for column in columns) or "none"
        shapes = [record_format.shape] if record_format.shape != "auto" else list(SHAPE_FIELDS)
        each = [" and ".join(map(repr, SHAPE_FIELDS[shape].required)) for shape in shapes]
        needs = ", ".join(each[:-1]) + ", or " + each[-1] if len(each) > 1 else each[0]
        raise LitsftError(
            f"{where} has no column of {'any record shape' if len(shapes) > 1 else f'record shape {shapes[0]}'} "
            f"(its columns: {named}); a record needs {needs}: name your columns' roles with --data.field_map, "
            'e.g. \'{"instruction": "question", "output": "answer"}\''
        )


def _detect_shape(record: dict, where: str) -> RecordShape:
    if None in record.values():
        present = frozenset(key for key, value in record.items() if value is not None)
    else:  # most records: every field is there
        present = frozenset(record)
    shape = _shape_of_fields_cached(present)
    if shape is None:
        fields = ", ".join(repr(key) for key in sorted(present)) or "none"
        raise LitsftError(f"{where}: the record fits no record shape (its fields: {fields}); {_SHAPES}")
    return shape


@functools.lru_cache(maxsize=256)
def _shape_of_fields_cached(present: frozenset[str]) -> RecordShape | None:
    # A dataset's records share their fields: decided once per set of fields, not for each of millions.
    return shape_of_fields(present)


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


def _preference(record: dict, where: str, tools: list[dict] | None) -> PreferencePair:
    """A prompt and its two replies. Without a prompt, the messages chosen and rejected share at their start
    are the prompt (as TRL's extract_prompt finds it), the rest of each its reply."""
    if record.get("prompt") is not None:
        prompt = _part(record, "prompt", "user", where)
        chosen = _part(record, "chosen", "assistant", where)
        rejected = _part(record, "rejected", "assistant", where)
        # Some sets give the prompt and whole conversations too (HuggingFaceH4/ultrafeedback_binarized).
        if chosen[: len(prompt)] == prompt and rejected[: len(prompt)] == prompt:
            chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
    else:
        for key in ("chosen", "rejected"):
            if not isinstance(record.get(key), list):
                raise LitsftError(
                    f"{where}: without a 'prompt', {key!r} must be a whole conversation (a list of messages), "
                    f"got {_type_name(record.get(key))}; add the prompt as 'prompt'"
                )
        whole_chosen = _messages(record, "chosen", where, None)
        whole_rejected = _messages(record, "rejected", where, None)
        shared = 0
        for a, b in zip(whole_chosen, whole_rejected):
            if a != b:
                break
            shared += 1
        # The replies start at the last message before which both agree that is not an assistant's own.
        while shared > 0 and whole_chosen[shared - 1]["role"] == "assistant":
            shared -= 1
        if shared == 0:
            raise LitsftError(
                f"{where}: 'chosen' and 'rejected' share no message at their start, so there is no prompt; "
                "give it as 'prompt'"
            )
        prompt, chosen, rejected = whole_chosen[:shared], whole_chosen[shared:], whole_rejected[shared:]
    for key, reply in (("chosen", chosen), ("rejected", rejected)):
        if not any(message["role"] == "assistant" for message in reply):
            raise LitsftError(f"{where}: {key!r} has no assistant message after the prompt; add the reply")
    return PreferencePair(prompt, chosen, rejected, tools)


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
        if len(message) > 2 or keys["content"] not in message:  # keys beside its role and content
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
