"""Small data sets laid out as their originals are, so nothing is downloaded: a repository shaped like
BAAI/Infinity-Instruct (https://huggingface.co/datasets/BAAI/Infinity-Instruct: a config per release, each a
folder of parquet shards, ShareGPT `conversations` with `from` human / gpt, plus `id`, `label`, `langdetect`
and `source` columns), served by tests/hub_server.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu red green blue cat dog".split()
CONFIG = "0625"


def sharegpt_rows(count: int, seed: int = 0, max_turns: int = 2) -> list[dict]:
    """Infinity-Instruct-like rows: an optional system prompt, then 1..max_turns human/gpt exchanges."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        conversation = []
        if rng.random() < 0.5:
            conversation.append({"from": "system", "value": "Answer in a few words."})
        for _ in range(rng.randint(1, max_turns)):
            conversation.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=3)) + "?"})
            conversation.append(
                {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=2)).capitalize() + "."}
            )
        rows.append(
            {
                "id": str(index),
                "conversations": conversation,
                "label": {"ability_en": ["word games"], "ability_zh": ["文字游戏"], "cate_ability_en": ["x"]},
                "langdetect": "en",
                "source": "tiny",
            }
        )
    return rows


def as_messages(rows: list[dict]) -> list[dict]:
    """The same rows written as OpenAI-style `messages` records."""
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    return [
        {"messages": [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]}
        for row in rows
    ]


def write_infinity_instruct(directory: Path, rows: list[dict], shards: int = 2) -> Path:
    """The repository layout: README.md whose YAML names the config and its files, and the shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    (directory / CONFIG).mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(rows) // shards)
    for shard in range(shards):
        part = rows[shard * per_shard : (shard + 1) * per_shard]
        pq.write_table(
            pa.Table.from_pylist(part), directory / CONFIG / f"train-{shard:05d}-of-{shards:05d}.parquet"
        )
    card = (
        "---\nlicense: cc-by-sa-4.0\nconfigs:\n"
        f"- config_name: '{CONFIG}'\n  data_files:\n  - split: train\n    path: {CONFIG}/*\n---\n"
        "# A tiny stand-in for Infinity-Instruct\n"
    )
    (directory / "README.md").write_text(card)
    return directory


def write_json(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records, ensure_ascii=False, indent=1))
    return path


def registered_data_modules() -> list[str]:
    """The names `--data` takes: every class litsft.data exports that is a DataModule nothing else extends
    (DataModule and SFTDataModule are the interfaces the others build on)."""
    import litsft.data

    classes = [getattr(litsft.data, name) for name in litsft.data.__all__]
    return sorted(
        cls.__name__
        for cls in classes
        if isinstance(cls, type) and issubclass(cls, litsft.data.DataModule) and not cls.__subclasses__()
    )


def damage_a_page(path: Path, row_group: int) -> None:
    """Overwrite bytes of the data pages of the conversations' values in `row_group` of the parquet file
    `path` (compressed text, nothing else's): its footer stays intact, so the file opens, and only reading
    that row group fails."""
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata.row_group(row_group)
    names = [metadata.column(i).path_in_schema for i in range(metadata.num_columns)]
    column = metadata.column(names.index("conversations.list.element.value"))
    with open(path, "r+b") as file:
        file.seek(column.data_page_offset + 40)
        file.write(b"\xff" * 64)
