"""Which parquet files make up a split of a Hugging Face dataset, resolved as `datasets` resolves them, and
their local copies: what `hf_dataset.HFDataset` reads straight with pyarrow (`parquet_rows.ParquetRows`)
instead of letting `datasets` convert them into its arrow cache first, whose memory grows with the files.

`datasets.load_dataset_builder` resolves the split's data files, as `load_dataset` would (the dataset card's
configs, --data.name, --data.revision, --data.data_files; HF_ENDPOINT, HF_TOKEN). When its builder is
`datasets`' parquet builder and every file is local or on the hub, the hub's files are downloaded at their
commit by huggingface_hub into its cache (HF_HOME/hub), as `datasets` downloads them. Anything else (other
file types, a folder written by `save_to_disk`, files at other URLs) is left to `datasets`: None.

Offline (HF_HUB_OFFLINE), `datasets` can only list a hub dataset's files from the arrow cache it converted
them into; so each hub split resolved here is recorded (the files at their commit) under
HF_HOME/datasets/litsft_parquet_splits, and read back offline, with the files from the hub cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from litsft.data.parquet_rows import file_identity

HUB_PREFIX = "hf://datasets/"


@dataclass(frozen=True)
class ParquetSplit:
    """The local copies of a split's parquet files, what identifies each (a local file's path, size and
    modification time; a hub file's URL at its commit), and the features the dataset declares (its card's
    dataset_info: `datasets` casts the columns to them), None when it declares none."""

    files: list[str]
    identities: list[Any]
    features: Any = None


def parquet_split(
    path: str, name: str | None, revision: str | None, data_files: list[str] | None, split: str
) -> ParquetSplit | None:
    """The parquet files of `split` of the dataset `path` (a local .parquet file, a folder, or a hub id), or
    None when `datasets` reads them otherwise (see the module docstring). A split the dataset does not have
    raises `datasets`' ValueError ("Unknown split ..."); the hub's errors are huggingface_hub's."""
    local = Path(path)
    if local.is_file():
        return ParquetSplit([str(local)], [file_identity(str(local))]) if local.suffix == ".parquet" else None
    import datasets
    import datasets.config

    request = {"path": path, "name": name, "revision": revision, "data_files": data_files}
    recorded = None if local.exists() else _recorded(request)
    if recorded is not None and datasets.config.HF_HUB_OFFLINE:
        try:
            return _split_of(recorded["splits"], recorded["features"], split)
        except (OSError, ValueError):
            pass  # a file gone from the hub cache: `datasets` says what it has (or that it needs the hub)
    builder = datasets.load_dataset_builder(path, name=name, revision=revision, data_files=data_files)
    if builder.name != "parquet" or builder.config.columns or builder.config.filters:
        return None
    splits = {key: [str(file) for file in files] for key, files in builder.config.data_files.items()}
    if not all(
        file.startswith(HUB_PREFIX) or os.path.isfile(file) for files in splits.values() for file in files
    ):
        return None
    features = builder.info.features.to_dict() if builder.info.features is not None else None
    if not local.exists():
        _record(request, {"splits": splits, "features": features})
    return _split_of(splits, features, split)


def _split_of(splits: dict[str, list[str]], features: dict | None, split: str) -> ParquetSplit:
    import datasets

    if split not in splits:
        raise ValueError(f'Unknown split "{split}". Should be one of {list(splits)}.')
    files = splits[split]
    return ParquetSplit(
        [_hub_download(file) if file.startswith(HUB_PREFIX) else file for file in files],
        [file if file.startswith(HUB_PREFIX) else file_identity(file) for file in files],
        datasets.Features.from_dict(features) if features is not None else None,
    )


def features_match(split: ParquetSplit) -> bool:
    """Whether values read straight from the files are the ones `datasets` gives: the features the dataset
    declares, if any, are those `datasets` infers from its first file's schema (it casts nothing), and none of
    them is decoded (an image, an audio clip)."""
    import pyarrow.parquet

    if not split.files:
        return True
    schema = pyarrow.parquet.read_schema(split.files[0])
    if split.features is None and b"huggingface" not in (schema.metadata or {}):
        return True  # plain arrow types, which `datasets` reads as they are
    import datasets
    from datasets.features.features import require_decoding

    inferred = datasets.Features.from_arrow_schema(schema)
    if any(require_decoding(feature) for feature in inferred.values()):
        return False
    return split.features is None or split.features == inferred


def _hub_download(url: str) -> str:
    """The local copy of hf://datasets/<repo>@<commit>/<file>, downloaded at that commit by huggingface_hub
    into its cache when not there yet (offline: from the cache), as `datasets` downloads it."""
    import datasets.config
    import huggingface_hub

    repo, _, rest = url[len(HUB_PREFIX) :].partition("@")
    revision, _, filename = rest.partition("/")
    return huggingface_hub.hf_hub_download(
        repo_id=repo,
        filename=filename,
        repo_type="dataset",
        revision=unquote(revision),
        endpoint=datasets.config.HF_ENDPOINT,
    )


def _record_path(request: dict[str, Any]) -> Path:
    import datasets.config

    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
    return Path(datasets.config.HF_DATASETS_CACHE) / "litsft_parquet_splits" / f"{key}.json"


def _record(request: dict[str, Any], resolved: dict[str, Any]) -> None:
    """Keep what `request` resolved to, for offline use: written whole or not at all (ranks may race)."""
    path = _record_path(request)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps(resolved))
        os.replace(staging, path)
    except OSError:
        pass  # a read-only HF_HOME: offline use then needs `datasets`' own cache, as before


def _recorded(request: dict[str, Any]) -> dict[str, Any] | None:
    path = _record_path(request)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
