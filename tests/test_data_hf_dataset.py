"""`--data HFDataset` (litsft/data/hf_dataset.py): the same records from the hub, parquet, arrow, a
save_to_disk folder, CSV and JSON give the same tokens and loss masks; hub, gated and offline cases fail in one
line. Hub datasets come from tests/hub_server.py, in process: `datasets` and huggingface_hub read their
endpoint, cache and offline settings at import, so `hub_settings` sets those module constants."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from hub_server import LocalHub
from tiny_datasets import (
    CONFIG,
    as_messages,
    damage_a_page,
    sharegpt_rows,
    write_infinity_instruct,
    write_json,
)

from litsft.data import JSON, HFDataset
from litsft.errors import LitsftError

REPO = "BAAI/Infinity-Instruct"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local hub serving an Infinity-Instruct-shaped dataset, and `datasets` pointed at it."""
    with LocalHub() as hub:
        hub_settings(monkeypatch, hub.url, tmp_path / "hf-home", offline=False)
        yield hub


def hub_settings(monkeypatch, url: str, home: Path, offline: bool) -> None:
    """What HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE set when `datasets` and huggingface_hub are imported."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
    monkeypatch.setattr(
        datasets.config, "HUB_DATASETS_URL", url + "/datasets/{repo_id}/resolve/{revision}/{path}"
    )
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", offline)


def prepared(data, tokenizer, max_seq_length: int = 256):
    data.connect(tokenizer, max_seq_length, seed=0)
    data.prepare()
    data.setup()
    return data


def assert_same_samples(first, second) -> None:
    for name in ("tokens", "targets", "starts", "lengths", "first_targets"):
        np.testing.assert_array_equal(getattr(first.train_samples, name), getattr(second.train_samples, name))


def test_every_source_of_the_same_records_gives_the_same_tokens_and_masks(hub, tmp_path, tokenizer):
    import datasets

    rows = sharegpt_rows(12, max_turns=1)  # one exchange each, so that CSV columns can hold them too
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "repo", rows))
    options = {"cache_dir": tmp_path / "cache", "val_split_fraction": 0.0}
    reference = prepared(
        JSON(json_path=write_json(tmp_path / "messages.json", as_messages(rows)), **options), tokenizer
    )

    table = datasets.Dataset.from_list(rows)
    table.to_parquet(tmp_path / "train.parquet")
    table.save_to_disk(tmp_path / "saved")
    arrow_file = next((tmp_path / "saved").glob("*.arrow"))
    with open(tmp_path / "train.csv", "w", newline="") as file:  # Alpaca-like columns of other names
        writer = csv.DictWriter(file, ["system_prompt", "question", "answer"])
        writer.writeheader()
        for row in rows:
            by_role = {m["from"]: m["value"] for m in row["conversations"]}
            writer.writerow(
                {
                    "system_prompt": by_role.get("system", ""),
                    "question": by_role["human"],
                    "answer": by_role["gpt"],
                }
            )
    csv_fields = {"system": "system_prompt", "instruction": "question", "output": "answer"}

    sources = {
        "sharegpt json": JSON(json_path=write_json(tmp_path / "sharegpt.json", rows), **options),
        "hub": HFDataset(path=REPO, name=CONFIG, **options),
        "parquet": HFDataset(path=str(tmp_path / "train.parquet"), **options),
        "arrow": HFDataset(path=str(arrow_file), **options),
        "save_to_disk": HFDataset(path=str(tmp_path / "saved"), **options),
        "csv": HFDataset(path=str(tmp_path / "train.csv"), field_map=csv_fields, **options),
    }
    for name, data in sources.items():
        print(name)
        assert_same_samples(prepared(data, tokenizer), reference)
    assert len(reference.train_samples) == len(rows)


def first_batch(data, tokenizer):
    prepared(data, tokenizer)
    return next(iter(data.train_dataloader(rank=0, world_size=1, micro_batch_size=2, global_batch_size=2)))


def test_infinity_instruct_from_the_hub_batches_as_the_same_records_written_as_messages(
    hub, tmp_path, tokenizer
):
    rows = sharegpt_rows(40, seed=1, max_turns=3)
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "repo", rows, shards=3))
    hub_data = HFDataset(path=REPO, name=CONFIG, cache_dir=tmp_path / "cache")
    json_data = JSON(
        json_path=write_json(tmp_path / "messages.json", as_messages(rows)), cache_dir=tmp_path / "cache"
    )
    from_hub, from_json = first_batch(hub_data, tokenizer), first_batch(json_data, tokenizer)
    assert from_hub.keys() == from_json.keys()
    for key in from_hub:
        assert from_hub[key].tolist() == from_json[key].tolist(), key
    assert (from_hub["labels"] != -100).sum() > 10
    # Only the parquet shards of the config and the card were fetched, through the dataset API.
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path}
    assert fetched == {"README.md", *(f"train-{i:05d}-of-00003.parquet" for i in range(3))}


def test_gated_dataset_without_a_token_is_one_line_and_loads_with_one(hub, tmp_path, tokenizer, monkeypatch):
    hub.add_dataset("org/gated", write_infinity_instruct(tmp_path / "repo", sharegpt_rows(4)), token="secret")
    data = HFDataset(path="org/gated", name=CONFIG, cache_dir=tmp_path / "cache")
    data.connect(tokenizer, 64, seed=0)
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert str(error.value) == (
        "org/gated is a gated dataset: accept its conditions on its dataset page, then set HF_TOKEN to a token "
        "of that account"
    )
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv("HF_TOKEN", "secret")  # with the token, as for models
    assert len(
        prepared(
            HFDataset(path="org/gated", name=CONFIG, cache_dir=tmp_path / "cache"), tokenizer
        ).train_samples
    )


def test_offline_a_cached_dataset_loads_and_an_uncached_one_is_one_line(
    hub, tmp_path, tokenizer, monkeypatch
):
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "repo", sharegpt_rows(8)))
    online = prepared(HFDataset(path=REPO, name=CONFIG, cache_dir=tmp_path / "cache"), tokenizer)
    hub_settings(
        monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True
    )  # nothing answers there
    offline = prepared(HFDataset(path=REPO, name=CONFIG, cache_dir=tmp_path / "other-cache"), tokenizer)
    assert offline.fingerprint() == online.fingerprint()
    assert_same_samples(offline, online)

    missing = HFDataset(path="BAAI/Other", name=CONFIG, cache_dir=tmp_path / "cache")
    missing.connect(tokenizer, 64, seed=0)
    with pytest.raises(LitsftError) as error:
        missing.prepare()
    assert str(error.value) == (
        "HF_HUB_OFFLINE is set and BAAI/Other (config 0625) was never loaded on this machine; load it once where "
        "the hub is reachable (the `datasets` cache in HF_HOME keeps it), or unset HF_HUB_OFFLINE"
    )


def test_a_record_of_no_known_shape_names_the_dataset_row_and_its_fields(tmp_path, tokenizer, monkeypatch):
    import datasets

    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    rows = [
        {"instruction": "a", "output": "b", "question": None},
        {"instruction": None, "output": None, "question": "q"},
    ]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "mixed.parquet")
    data = HFDataset(
        path=str(tmp_path / "mixed.parquet"), field_map={"query": "question"}, cache_dir=tmp_path / "c"
    )
    data.connect(tokenizer, 64, seed=0)
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert str(error.value).startswith(
        f"{tmp_path / 'mixed.parquet'} split train row 1: the record fits no record shape (its fields: 'query', "
        "'question'); each record needs 'messages', 'conversations' (ShareGPT)"
    )


def test_a_missing_path_and_a_wrong_config_are_one_line(hub, tmp_path, tokenizer):
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "repo", sharegpt_rows(4)))
    with pytest.raises(LitsftError, match=r"^--data.path nowhere/data.parquet is neither an existing file"):
        HFDataset(path="nowhere/data.parquet").fingerprint()
    with pytest.raises(
        LitsftError, match=rf"^{REPO} has no config '7M': .*; pass one of them as --data.name$"
    ):
        HFDataset(path=REPO, name="7M").fingerprint()
    with pytest.raises(
        LitsftError, match=r"^--data.path org/none is not a local path and http://127.0.0.1:\d+ has no"
    ):
        HFDataset(path="org/none").fingerprint()


def test_a_validation_split_and_the_fingerprint(tmp_path, tokenizer, monkeypatch):
    import datasets

    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    rows = sharegpt_rows(10)
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:7]), "test": datasets.Dataset.from_list(rows[7:])}
    )
    splits.save_to_disk(tmp_path / "saved")
    data = prepared(
        HFDataset(path=str(tmp_path / "saved"), val_split="test", cache_dir=tmp_path / "c"), tokenizer
    )
    assert (len(data.train_samples), len(data.val_samples)) == (7, 3)
    with pytest.raises(
        LitsftError, match=r"saved has no split 'dev'; it has train, test; pass --data.split$"
    ):
        HFDataset(path=str(tmp_path / "saved"), val_split="dev").fingerprint()

    # The fingerprint (checked on resume) follows the records and the options that read them.
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "rows.parquet")
    before = HFDataset(path=str(tmp_path / "rows.parquet")).fingerprint()
    assert HFDataset(path=str(tmp_path / "rows.parquet")).fingerprint() == before
    assert (
        HFDataset(path=str(tmp_path / "rows.parquet"), role_map={"bot": "assistant"}).fingerprint() != before
    )
    datasets.Dataset.from_list(rows[:9]).to_parquet(tmp_path / "rows.parquet")
    assert HFDataset(path=str(tmp_path / "rows.parquet")).fingerprint() != before


def test_data_files_and_a_revision_pick_what_is_loaded(hub, tmp_path, tokenizer):
    rows = sharegpt_rows(10)
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "main", rows, shards=2))
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "v2", rows[:4], shards=1), revision="v2")
    options = {"cache_dir": tmp_path / "cache", "val_split_fraction": 0.0}
    first_shard = HFDataset(path=REPO, data_files=[f"{CONFIG}/train-00000-of-00002.parquet"], **options)
    assert len(prepared(first_shard, tokenizer).train_samples) == 5
    assert (
        len(prepared(HFDataset(path=REPO, name=CONFIG, revision="v2", **options), tokenizer).train_samples)
        == 4
    )


def test_validation_prompts_are_the_same_whether_read_from_tokens_or_from_records(
    tmp_path, tokenizer, monkeypatch
):
    """The validation sample's prompts: cut from the held-out samples' tokens (mask_prompt) or rendered from
    the held-out records (every token trained); the same for a parquet dataset."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    datasets.Dataset.from_list(sharegpt_rows(20)).to_parquet(tmp_path / "train.parquet")
    prompts = [
        prepared(HFDataset(path=str(tmp_path / "train.parquet"), mask_prompt=mask, cache_dir=tmp_path / "cache",
                           val_split_fraction=0.2), tokenizer).validation_prompts(2)
        for mask in (True, False)
    ]  # fmt: skip
    assert prompts[0] == prompts[1] and len(prompts[0]) == 2
    assert tokenizer.decode(prompts[0][0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_columns_of_no_record_shape_are_named_with_field_map(tmp_path, monkeypatch):
    """Question/answer columns, or a JSON object of splits, fit no shape: one line naming the columns and
    --data.field_map (not "raise max_seq_length" after tokenizing nothing); mapped, the same columns load."""
    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    qa = write_json(tmp_path / "qa.json", [{"question": "Hi", "answer": "Hello", "id": 1}])
    splits = tmp_path / "splits.json"
    splits.write_text('{"train": [{"instruction": "a", "output": "b"}], "test": []}')
    for path, columns in ((qa, "'question', 'answer', 'id'"), (splits, "'train', 'test'")):
        with pytest.raises(LitsftError) as error:
            HFDataset(path=str(path)).sources()
        assert str(error.value) == (
            f"{path} split train has no column of any record shape (its columns: {columns}); a record needs "
            "'messages', 'conversations', 'instruction' and 'output', 'prompt' and 'completion', 'chosen' and 'rejected', or 'text': "
            """name your columns' roles with --data.field_map, e.g. '{"instruction": "question", "output": "answer"}'"""
        )
    with pytest.raises(LitsftError, match=r"has no column of record shape text \(its columns: 'question'"):
        HFDataset(path=str(qa), record_shape="text").sources()
    mapped = HFDataset(path=str(qa), field_map={"instruction": "question", "output": "answer"})
    assert list(mapped.sources()["train"][1]()) == [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ]


def test_the_columns_decoded_are_the_record_shapes_fields(tmp_path, monkeypatch):
    """records.py's SHAPE_FIELDS is the one list: a shape added there is decoded from a dataset's columns."""
    from litsft.data import records

    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    path = write_json(tmp_path / "qa.json", [{"question": "Hi", "answer": "Hello", "id": 1, "text": "t"}])
    assert HFDataset(path=str(path))._load_split("train")[0].column_names == ["text"]
    shapes = {**records.SHAPE_FIELDS, "qa": records.ShapeFields(("question", "answer"))}
    monkeypatch.setattr(records, "SHAPE_FIELDS", shapes)
    assert HFDataset(path=str(path))._load_split("train")[0].column_names == ["question", "answer", "text"]


def test_a_folder_of_several_file_types_is_refused_and_data_files_picks_one(tmp_path, monkeypatch):
    import datasets

    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    datasets.Dataset.from_list([{"instruction": "c", "output": "d"}] * 2).to_parquet(folder / "b.parquet")
    with pytest.raises(LitsftError) as error:
        HFDataset(path=str(folder)).sources()
    assert str(error.value) == (
        f"--data.path {folder} holds files of several types (.jsonl, .parquet) and `datasets` would read only "
        """one type of them; convert them to one type, or pick one with --data.data_files, e.g. '["**/*.parquet"]'"""
    )
    assert len(HFDataset(path=str(folder), data_files=["*.parquet"]).sources()["train"][1]()) == 2


def test_a_broken_local_file_is_named_with_its_line(tmp_path, monkeypatch):
    """`datasets` says only "An error occurred while generating the dataset"; the file (and line) is named."""
    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    for path in (folder, folder / "train.jsonl"):
        with pytest.raises(LitsftError) as error:
            HFDataset(path=str(path)).sources()
        assert str(error.value) == (
            f"{folder / 'train.jsonl'} line 2: invalid JSON (Expecting ',' delimiter at column 13); each line "
            "of a .jsonl file must be one complete JSON record"
        )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.parquet").touch()
    with pytest.raises(LitsftError) as error:
        HFDataset(path=str(empty)).sources()
    assert str(error.value) == f"{empty / 'train.parquet'} is empty (0 bytes); remove it or write it again"


def test_a_parquet_file_with_a_damaged_page_is_named_not_the_cache(tmp_path, tokenizer, monkeypatch):
    """A damaged row group found by a tokenizing worker stops preparing with the file and row group named
    (it was reported as the cache's fault: 'cannot write the data cache ... set --data.cache_dir'), and no
    cache entry nor staging folder is left."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from litsft.data import samples

    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    monkeypatch.setattr(samples, "CHUNK_SIZE", 500)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(sharegpt_rows(3000)), path, row_group_size=1000)
    damage_a_page(path, row_group=2)
    data = HFDataset(path=str(path), cache_dir=tmp_path / "cache", tokenize_processes=2)
    data.connect(tokenizer, 256, seed=0)
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert str(error.value).startswith(f"{path} is damaged: row group 2 (rows 2,000 to 2,999 of the file)")
    assert "data cache" not in str(error.value)
    assert list((tmp_path / "cache" / "sft").iterdir()) == []


def test_the_arrow_cache_is_written_in_batches_of_arrow_batch_rows(hub, tmp_path, monkeypatch):
    """Opening `datasets`' arrow cache maps about 64 KB around each batch's header into the process:
    batches of ARROW_BATCH_ROWS rows (from a local file and from the hub, parquet read through `datasets`),
    not `datasets`' 1,000."""
    import datasets

    from litsft.data import hf_dataset

    monkeypatch.setattr(hf_dataset, "ARROW_BATCH_ROWS", 4)
    monkeypatch.setattr(hf_dataset, "READ_PARQUET_DIRECTLY", False)
    rows = sharegpt_rows(10)
    hub.add_dataset(REPO, write_infinity_instruct(tmp_path / "repo", rows))
    datasets.Dataset.from_list(rows).to_json(tmp_path / "rows.jsonl")
    for path in (str(tmp_path / "rows.jsonl"), REPO):
        table = HFDataset(path=path, name=CONFIG if path == REPO else None)._load_split("train")[0].data
        sizes = [batch.num_rows for batch in table.to_batches()]  # the hub's rows are in two files of 5
        assert sum(sizes) == 10 and max(sizes) == 4, (path, sizes)


def test_preference_pairs_read_the_same_from_json_parquet_and_the_hub(hub, tmp_path, tokenizer):
    """UltraFeedback-binarized rows (a prompt string, chosen and rejected whole conversations that repeat it)
    from a hub dataset's parquet shards and a local parquet file give the pairs that the same pairs written as
    prompt/chosen/rejected strings in JSON give: two samples a pair, the same tokens and loss masks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sharegpt_rows(10, seed=2, max_turns=1)
    ultrafeedback, plain = [], []
    for i, row in enumerate(rows):
        by_role = {m["from"]: m["value"] for m in row["conversations"]}
        prompt, chosen, rejected = by_role["human"], by_role["gpt"], f"not {by_role['gpt']} {i}"
        user = {"role": "user", "content": prompt}
        ultrafeedback.append(
            {
                "prompt": prompt,
                "chosen": [user, {"role": "assistant", "content": chosen}],
                "rejected": [user, {"role": "assistant", "content": rejected}],
                "score_chosen": 8.0,
            }
        )
        plain.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ultrafeedback), repo / "data" / "train_prefs-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_prefs\n"
        "    path: data/train_prefs-*\n---\n"
    )
    hub.add_dataset("org/ultrafeedback", repo)
    options = {"cache_dir": tmp_path / "cache", "val_split_fraction": 0.0}
    sources = {
        "json": JSON(json_path=write_json(tmp_path / "pairs.json", plain), **options),
        "hub": HFDataset(path="org/ultrafeedback", split="train_prefs", **options),
        "parquet": HFDataset(path=str(repo / "data" / "train_prefs-00000-of-00001.parquet"), **options),
    }
    for data in sources.values():
        data.train_pairs()
        data.check(None)
    reference = prepared(sources.pop("json"), tokenizer)
    assert len(reference.train_samples) == 2 * len(rows)
    for name, data in sources.items():
        print(name)
        assert_same_samples(prepared(data, tokenizer), reference)
