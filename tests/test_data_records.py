"""Reading records, and bad data failing with one line naming the file, the line and the fix
(litsft/data/records.py), before anything is written."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from litsft.data import JSON
from litsft.data.chat import TEXT_ROLE
from litsft.data.json_files import read_conversations
from litsft.data.records import DEFAULT_FORMAT, SHAPE_FIELDS, RecordFormat, RecordShape, to_conversation
from litsft.errors import LitsftError

SHAPES = (
    "each record needs 'messages', 'conversations' (ShareGPT), 'instruction' and 'output' (and optionally "
    "'input'), 'prompt' and 'completion', or 'text'; --data.field_map maps other field names"
)
GOOD = {"instruction": "Add.", "input": "1 + 2", "output": "3"}
GOOD_LINE = json.dumps(GOOD)

# (file name, file bytes, expected message after "<path> ")
BAD_DATA = {
    "bad_json": (
        "train.jsonl",
        f'{GOOD_LINE}\n{{"instruction": "a", "output": }}\n'.encode(),
        "line 2: invalid JSON (Expecting value at column 32); each line of a .jsonl file must be one complete JSON record",
    ),
    "unterminated_string": (
        "train.jsonl",
        f'{GOOD_LINE}\n{{"instruction": "a", "output": "b}}\n'.encode(),
        "line 2: invalid JSON (Unterminated string starting at column 32); each line of a .jsonl file must be "
        "one complete JSON record",
    ),
    "json_list_bad_value": (
        "train.json",
        f'[\n  {GOOD_LINE},\n  {{"instruction": "a", "output": }}\n]'.encode(),
        "line 3: invalid JSON (Expecting value at column 34); fix the record or remove it",
    ),
    "missing_field": (
        "train.jsonl",
        f'{GOOD_LINE}\n\n{{"instruction": "a"}}\n'.encode(),
        f"line 3: the record has no 'output'; {SHAPES}",
    ),
    "wrong_type": (
        "train.jsonl",
        b'{"instruction": "a", "output": 5}\n',
        "line 1: 'output' is a number (5), expected a string",
    ),
    "not_an_object": (
        "train.jsonl",
        b'["a", "b"]\n',
        f"line 1: a record must be a JSON object, got a list; {SHAPES}",
    ),
    "empty_file": ("train.jsonl", b"\n  \n", "is empty; add at least one record"),
    "empty_list": ("train.json", b"[]", "holds no records; add at least one record"),
    "non_utf8": (
        "train.jsonl",
        GOOD_LINE.encode() + b'\n{"instruction": "caf\xe9", "output": "x"}\n',
        "line 2: byte 0xe9 is not valid UTF-8; re-encode the file as UTF-8",
    ),
    "json_list_missing_field": (
        "train.json",
        f'[\n  {GOOD_LINE},\n  {GOOD_LINE},\n  {{"input": "x",\n   "output": "y"}}\n]'.encode(),
        f"line 4: the record has no 'instruction'; {SHAPES}",
    ),
    "json_list_syntax": (
        "train.json",
        f"[\n  {GOOD_LINE}\n  {GOOD_LINE}\n]".encode(),
        "line 3: invalid JSON (expected ',' or ']' after a record); fix the list syntax",
    ),
    "json_not_a_list": (
        "train.json",
        GOOD_LINE.encode(),
        "line 1: a .json data file must hold a list of records ([{...}, ...]); use .jsonl for one record per line",
    ),
    "bad_role": (
        "train.jsonl",
        b'{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
        "line 1: messages[0].role is 'human'; use one of system, user, assistant, tool",
    ),
    "messages_not_a_list": (
        "train.jsonl",
        b'{"messages": "hi"}',
        "line 1: 'messages' must be a non-empty list of {role, content} objects, got a string",
    ),
    "message_without_content": (
        "train.jsonl",
        b'{"messages": [{"role": "user"}]}',
        "line 1: messages[0] has no 'content'; every message needs 'role' and 'content'",
    ),
    "no_assistant": (
        "train.jsonl",
        b'{"messages": [{"role": "user", "content": "hi"}]}',
        "line 1: the conversation has no assistant message; add the reply to train on",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_fails_in_one_line_and_writes_nothing(case, tmp_path, tokenizer):
    name, content, message = BAD_DATA[case]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / name).write_bytes(content)
    data = JSON(json_path=data_dir, cache_dir=tmp_path / "cache")
    data.connect(tokenizer, 64, seed=0)
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert str(error.value) == f"{data_dir / name} {message}"
    assert "\n" not in str(error.value)
    assert not (tmp_path / "cache").exists()
    assert sorted(p.name for p in data_dir.iterdir()) == [name]


def test_a_bad_validation_file_stops_before_the_training_file_is_cached(tmp_path, tokenizer):
    (tmp_path / "train.jsonl").write_text(GOOD_LINE + "\n")
    (tmp_path / "val.jsonl").write_text('{"output": "x"}\n')
    data = JSON(json_path=tmp_path, cache_dir=tmp_path / "cache")
    data.connect(tokenizer, 64, seed=0)
    with pytest.raises(LitsftError, match=r"val.jsonl line 1: the record has no 'instruction'"):
        data.prepare()
    assert not (tmp_path / "cache").exists()


def test_missing_paths(tmp_path, tokenizer):
    data = JSON(json_path=tmp_path / "nope.jsonl", cache_dir=tmp_path / "cache")
    data.connect(tokenizer, 64, seed=0)
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert str(error.value) == (
        f"--data.json_path {tmp_path / 'nope.jsonl'} does not exist; pass a .json/.jsonl file or a directory"
    )
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(LitsftError) as error:
        read_conversations(tmp_path / "data.csv")
    assert (
        str(error.value)
        == f"{tmp_path / 'data.csv'} has an unsupported extension; use a .json or .jsonl file"
    )


SYSTEM_USER_ASSISTANT = [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
]
SAME_RECORD_IN_EVERY_SHAPE = {
    "messages": {"messages": SYSTEM_USER_ASSISTANT},
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "Be nice."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
        ]
    },
    "alpaca": {"instruction": "Hi", "output": "Hello", "system": "Be nice."},
    "prompt_completion": {"prompt": SYSTEM_USER_ASSISTANT[:2], "completion": "Hello"},
}
PLAIN_TEXT_SHAPES = {"text": {"text": "Hello"}}
PAIR_SHAPES = {"preference": {"prompt": SYSTEM_USER_ASSISTANT[:2], "chosen": "Hello", "rejected": "Go away"}}
"""Shapes read as a prompt and two replies (what preference objectives train on)."""
"""Shapes read as text to train on as is, not as a conversation: the record and the text it holds."""
RECORD_SHAPES = [shape for shape in get_args(RecordShape) if shape != "auto"]


def test_the_shapes_the_option_takes_are_the_shapes_with_fields() -> None:
    assert set(RECORD_SHAPES) == set(SHAPE_FIELDS)  # --data.record_shape takes every shape records.py reads


@pytest.mark.parametrize("shape", RECORD_SHAPES)
def test_every_shape_is_detected_or_named(shape):
    """Every shape `--data.record_shape` accepts, read from a record of it, detected and named."""
    every = {**SAME_RECORD_IN_EVERY_SHAPE, **PLAIN_TEXT_SHAPES, **PAIR_SHAPES}
    assert shape in every, f"add a record of shape {shape!r}"
    if shape in PAIR_SHAPES:
        for record_format in (DEFAULT_FORMAT, RecordFormat(shape=shape)):
            pair = to_conversation(PAIR_SHAPES[shape], record_format=record_format)
            assert pair == SYSTEM_USER_ASSISTANT[:2]
            assert pair.chosen == [{"role": "assistant", "content": "Hello"}]
            assert pair.rejected == [{"role": "assistant", "content": "Go away"}]
        return
    if shape in PLAIN_TEXT_SHAPES:
        record = PLAIN_TEXT_SHAPES[shape]
        expected = [{"role": TEXT_ROLE, "content": record["text"]}]
    else:
        record, expected = SAME_RECORD_IN_EVERY_SHAPE[shape], SYSTEM_USER_ASSISTANT
    assert to_conversation(record) == expected
    assert to_conversation(record, record_format=RecordFormat(shape=shape)) == expected


def test_fields_roles_and_message_keys_are_mapped():
    record = {
        "dialog": [{"speaker": "person", "text": "Hi"}, {"speaker": "bot", "text": "Hello"}],
        "extra": 1,
    }
    mapped = JSON(
        json_path="unused.json",
        field_map={"conversations": "dialog"},
        role_map={"person": "user", "bot": "assistant"},
        message_map={"role": "speaker", "content": "text"},
    ).record_format()
    assert to_conversation(record, "r", mapped) == SYSTEM_USER_ASSISTANT[1:]
    unmapped = RecordFormat(
        field_map={"conversations": "dialog"}, message_map={"role": "speaker", "content": "text"}
    )
    with pytest.raises(LitsftError) as error:
        to_conversation(record, "data.json line 3", unmapped)
    assert str(error.value).startswith(
        "data.json line 3: conversations[0].speaker is 'person'; use one of human, user, gpt, assistant"
    )
    assert str(error.value).endswith("; map it with --data.role_map")
    alpaca = to_conversation(
        {"q": "Hi", "a": "Hello"}, "r", RecordFormat(field_map={"instruction": "q", "output": "a"})
    )
    assert alpaca == SYSTEM_USER_ASSISTANT[1:]


def test_tools_tool_calls_and_reasoning_reach_the_conversation():
    call = {"id": None, "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": None}}}
    record = {
        "messages": [
            {"role": "user", "content": "Use f"},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "f fits"},
            {"role": "tool", "content": "2", "tool_call_id": None, "name": "f"},
            {"role": "assistant", "content": "It is 2.", "thinking": None, "reasoning": "f said 2"},
        ],
        "tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": None}}]),
    }
    conversation = to_conversation(record)
    # Columnar files fill missing fields with null: dropped, as the JSON the records came from had no such key.
    assert conversation.tools == [{"type": "function", "function": {"name": "f"}}]
    assert conversation[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        "reasoning_content": "f fits",
    }
    assert conversation[2] == {"role": "tool", "content": "2", "name": "f"}
    assert conversation[3] == {"role": "assistant", "content": "It is 2.", "reasoning": "f said 2"}
    # A message of two keys, its role and a call without content, keeps the call.
    only_a_call = to_conversation(
        {"messages": [record["messages"][0], {"role": "assistant", "tool_calls": [call]}]}
    )
    assert only_a_call[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": conversation[1]["tool_calls"],
    }


def test_plain_text_records_train_on_every_token(tmp_path, tokenizer):
    (tmp_path / "text.jsonl").write_text('{"text": "Once upon a time"}\n{"text": "The end."}\n')
    data = JSON(json_path=tmp_path / "text.jsonl", cache_dir=tmp_path / "cache", val_split_fraction=0)
    data.connect(tokenizer, 64, seed=0)
    data.prepare()
    data.setup()
    samples = data.train_samples
    first, first_targets = samples.sample(0)
    assert tokenizer.decode(first.tolist(), skip_special_tokens=False) == "Once upon a time<|end_of_text|>"
    assert first_targets[1:].all()  # every token after the first (nothing precedes it)


def test_a_record_of_no_shape_names_its_fields(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(LitsftError) as error:
        read_conversations(tmp_path / "a.jsonl")
    assert str(error.value) == (
        f"{tmp_path / 'a.jsonl'} line 1: the record fits no record shape (its fields: 'answer', 'question'); {SHAPES}"
    )
