"""litsft/data/hf_parquet.py through `--data HFDataset`: a split whose files are all parquet (a local file, a
folder with train and test splits, a hub dataset) is read straight from its files and gives a cache
byte-identical to the one written from `datasets`' arrow cache (hf_dataset.READ_PARQUET_DIRECTLY off); a
file written again in place is tokenized again; a card declaring other features, and a missing split, behave
as through `datasets`."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_server import LocalHub
from test_data_hf_dataset import hub_settings
from tiny_datasets import CONFIG, sharegpt_rows, write_infinity_instruct

from litsft.data import HFDataset, hf_dataset, parquet_rows, samples
from litsft.data.parquet_rows import ParquetRows
from litsft.errors import LitsftError

REPO = "BAAI/Infinity-Instruct"
CACHE_FILES = ("tokens.bin", "targets.bin", "lengths.npy", "first_targets.npy")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)


def write_parquet(path, rows: list[dict], row_group_size: int = 7) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return str(path)


def cache_entries(data, tokenizer, monkeypatch, directly: bool, **options) -> dict[str, dict[str, bytes]]:
    """Prepare `data` (read straight from its files or through `datasets`) and return each split's cache
    entry files; checks which way its rows were read."""
    monkeypatch.setattr(hf_dataset, "READ_PARQUET_DIRECTLY", directly)
    data.connect(tokenizer, 64, seed=0)
    data.prepare()
    entries = {}
    for split, (identity, read) in data.sources().items():
        assert isinstance(read().dataset, ParquetRows) == directly, split
        entry = data._cached(identity)
        entries[split] = {name: (entry / name).read_bytes() for name in CACHE_FILES}
    return entries


def assert_same_cache_both_ways(make_data, tokenizer, monkeypatch, tmp_path) -> dict[str, dict[str, bytes]]:
    through_datasets = cache_entries(make_data(tmp_path / "cache-datasets"), tokenizer, monkeypatch, False)
    direct = cache_entries(make_data(tmp_path / "cache-direct"), tokenizer, monkeypatch, True)
    assert direct.keys() == through_datasets.keys()
    for split in direct:
        for name in CACHE_FILES:
            assert direct[split][name] == through_datasets[split][name], (split, name)
    return direct


def test_a_local_file_read_in_worker_processes_gives_the_cache_datasets_gives(
    tmp_path, tokenizer, monkeypatch, offline
):
    """Row groups of 7 rows, read 4 at a time, tokenized in chunks of 10 by 2 forked workers: each worker
    reads on from its place or starts again at the row group of its next chunk."""
    monkeypatch.setattr(samples, "CHUNK_SIZE", 10)
    monkeypatch.setattr(parquet_rows, "BATCH_ROWS", 4)
    path = write_parquet(tmp_path / "train.parquet", sharegpt_rows(95, max_turns=3))
    entries = assert_same_cache_both_ways(
        lambda cache: HFDataset(path=path, cache_dir=cache, val_split_fraction=0.0, tokenize_processes=2),
        tokenizer,
        monkeypatch,
        tmp_path,
    )
    assert len(entries["train"]["lengths.npy"]) > 95 * 8


def test_a_folder_with_train_and_test_splits_gives_the_caches_datasets_gives(
    tmp_path, tokenizer, monkeypatch, offline
):
    folder = tmp_path / "folder"
    (folder / "data").mkdir(parents=True)
    rows = sharegpt_rows(40, seed=2)
    write_parquet(folder / "data" / "train-00000-of-00002.parquet", rows[:15])
    write_parquet(folder / "data" / "train-00001-of-00002.parquet", rows[15:30], row_group_size=4)
    write_parquet(folder / "data" / "test-00000-of-00001.parquet", rows[30:])
    entries = assert_same_cache_both_ways(
        lambda cache: HFDataset(path=str(folder), val_split="test", cache_dir=cache),
        tokenizer,
        monkeypatch,
        tmp_path,
    )
    assert set(entries) == {"train", "val"}

    # A split the folder does not have: the same line either way.
    for directly in (False, True):
        monkeypatch.setattr(hf_dataset, "READ_PARQUET_DIRECTLY", directly)
        with pytest.raises(LitsftError) as error:
            HFDataset(path=str(folder), val_split="dev").sources()
        assert str(error.value) == (
            f"""{folder} has no split 'dev': Unknown split "dev". Should be one of ['train', 'test'].; pass """
            "--data.split"
        )


def test_a_hub_dataset_gives_the_cache_datasets_gives_and_is_read_offline_from_its_record(
    tmp_path, tokenizer, monkeypatch
):
    with LocalHub() as hub:
        hub_settings(monkeypatch, hub.url, tmp_path / "hf-home", offline=False)
        hub.add_dataset(
            REPO, write_infinity_instruct(tmp_path / "repo", sharegpt_rows(30, max_turns=3), shards=3)
        )
        entries = assert_same_cache_both_ways(
            lambda cache: HFDataset(path=REPO, name=CONFIG, cache_dir=cache, val_split_fraction=0.0),
            tokenizer,
            monkeypatch,
            tmp_path,
        )
        online = HFDataset(path=REPO, name=CONFIG).fingerprint()
    # Offline, `datasets` cannot list the files; the split resolved online is read back with its files.
    hub_settings(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf-home", offline=True)
    direct = cache_entries(
        HFDataset(path=REPO, name=CONFIG, cache_dir=tmp_path / "cache-offline", val_split_fraction=0.0),
        tokenizer,
        monkeypatch,
        True,
    )
    assert direct == entries
    assert HFDataset(path=REPO, name=CONFIG).fingerprint() == online


def test_a_file_written_again_in_place_is_tokenized_again(tmp_path, tokenizer, monkeypatch, offline):
    path = write_parquet(tmp_path / "train.parquet", sharegpt_rows(10, seed=3))
    options = {"cache_dir": tmp_path / "cache", "val_split_fraction": 0.0}
    first = cache_entries(HFDataset(path=path, **options), tokenizer, monkeypatch, True)
    written = os.stat(path)
    write_parquet(tmp_path / "train.parquet", sharegpt_rows(10, seed=4))
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns + 1_000_000))  # even within one clock tick
    again = cache_entries(HFDataset(path=path, **options), tokenizer, monkeypatch, True)
    assert again["train"]["tokens.bin"] != first["train"]["tokens.bin"]
    reference = cache_entries(HFDataset(path=path, **options), tokenizer, monkeypatch, False)
    assert again == reference


def test_a_card_declaring_other_features_is_read_through_datasets(tmp_path, tokenizer, monkeypatch, offline):
    """`datasets` casts the columns to the features a card declares: read as the files store them, the
    values could differ, so such a dataset goes through `datasets`. Features equal to the files' are read
    straight."""
    folder = tmp_path / "folder"
    folder.mkdir()
    write_parquet(folder / "train.parquet", [{"text": "one"}, {"text": "two"}])
    for dtype, directly in (("string", True), ("large_string", False)):
        (folder / "README.md").write_text(
            f"---\ndataset_info:\n  features:\n  - name: text\n    dtype: {dtype}\n---\n"
        )
        read = HFDataset(path=str(folder), cache_dir=tmp_path / "cache").sources()["train"][1]
        assert isinstance(read().dataset, ParquetRows) == directly, dtype
        assert [messages[0]["content"] for messages in read()] == ["one", "two"]


def test_a_column_datasets_decodes_is_read_through_datasets(tmp_path, tokenizer, offline):
    """A file written by `datasets` with an image column: `datasets` decodes it (to a PIL image), so the
    split goes through `datasets`; the same file's text column alone, written by pyarrow, is read straight."""
    import datasets
    from PIL import Image

    features = datasets.Features({"text": datasets.Value("string"), "image": datasets.Image()})
    images = [Image.new("RGB", (2, 2)), Image.new("RGB", (2, 2))]
    datasets.Dataset.from_dict({"text": ["one", "two"], "image": images}, features=features).to_parquet(
        tmp_path / "images.parquet"
    )
    write_parquet(tmp_path / "text.parquet", [{"text": "one"}, {"text": "two"}])
    for name, directly in (("images.parquet", False), ("text.parquet", True)):
        read = HFDataset(path=str(tmp_path / name), cache_dir=tmp_path / "cache").sources()["train"][1]
        assert isinstance(read().dataset, ParquetRows) == directly, name
        assert [messages[0]["content"] for messages in read()] == ["one", "two"]
