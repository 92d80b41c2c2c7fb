"""Reading .json / .jsonl record files (litsft/data/json_files.py)."""

from __future__ import annotations

import json

from litsft.data.json_files import read_conversations

GOOD = {"instruction": "Add.", "input": "1 + 2", "output": "3"}


def test_json_and_jsonl_hold_the_same_records(tmp_path):
    records = [
        GOOD,
        {"instruction": "Hi", "output": "Hello", "system": "Be nice."},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    conversations = read_conversations(tmp_path / "a.json")
    assert conversations == read_conversations(tmp_path / "a.jsonl")
    assert conversations == [
        [{"role": "user", "content": "Add.\n\n1 + 2"}, {"role": "assistant", "content": "3"}],
        [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]
