"""`--data HFDataset`: records of a Hugging Face dataset, from the Hub by name or from local parquet / arrow /
csv / json(l) files, folders of them, or a folder written by `save_to_disk`.

A split whose files are all parquet (a local file, a folder of them, and most hub datasets) is read straight
from its files with pyarrow, a slice at a time (hf_parquet.py resolves and downloads its files as `datasets`
would, honouring HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE; parquet_rows.py reads them), so preparing holds
one slice per process however large the set. Every other source is loaded through `datasets`, which downloads
and converts the records once into its own memory-mapped cache (HF_HOME/datasets). Rank 0 tokenizes into
litsft's cache; the other ranks find the files (or the `datasets` cache) and the tokens in litsft's, keyed by
the files (local: path, size and modification time; hub: each file at its commit) or by `datasets`'
fingerprint. Rows are converted to conversations one chunk at a time (`DatasetConversations`), so a large set
never holds every row's Python objects at once. `datasets` is imported only when data is loaded, and not for
a local parquet file: it is slow to import.

Only the columns some record shape reads are decoded (records.py's SHAPE_FIELDS, through --data.field_map);
a split without any of them is refused naming its columns. A local folder of several file types is refused
(`datasets` reads one type of them), and a local file that fails to load is named, with its line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from litsft.data.base import RecordDataModule, digest_of
from litsft.data.chat import Conversation, Message
from litsft.data.hf_parquet import features_match, parquet_split
from litsft.data.json_files import iter_records
from litsft.data.parquet_rows import ParquetRows, open_parquet
from litsft.data.records import RecordFormat, check_columns, record_fields, to_conversation
from litsft.errors import LitsftError

STREAMING_REFUSED = (
    "--data.streaming true is not supported: each epoch's batches (the shuffle, best-fit packing, the same "
    "global batches on any number of ranks, and exact resume) are planned from every sample's length, which a "
    "stream knows only at its end; prepare the set up front (`litsft prepare`, about 5 bytes a token, "
    "memory-mapped) or take part of it with --data.data_files"
)
# The `datasets` builder that reads each local file type.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
ARROW_BATCH_ROWS = 10_000
"""Rows per record batch of the arrow cache `datasets` converts records other than parquet into (its
default: 1,000).
Opening that cache reads every batch's header through its memory map, and each read maps about 64 KB of
the file into the process (the kernel maps the pages around a fault): 2,000 batches of 2M rows kept
131 MB of the file resident in the process that loaded it, 200 batches 18 MB. One tokenizing chunk
(samples.CHUNK_SIZE) is one batch. Not part of `datasets`' cache key: a set it converted before keeps
its batches, and its fingerprint."""
READ_PARQUET_DIRECTLY = True
"""Read a split whose files are all parquet straight from them (hf_parquet.py, parquet_rows.py); False lets
`datasets` convert them into its arrow cache first, as it does every other file type."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


@dataclass(kw_only=True)
class HFDataset(RecordDataModule):
    """Records from a Hugging Face dataset, by hub id or local path, in any record shape (see records.py)."""

    path: str
    """A hub dataset id (e.g. BAAI/Infinity-Instruct), a local .parquet / .arrow / .csv / .json / .jsonl
    file, a folder of such files, or a folder written by `datasets`' save_to_disk."""
    name: str | None = None
    """The dataset's configuration (subset), e.g. 0625 for BAAI/Infinity-Instruct."""
    split: str = "train"
    """The split to train on."""
    val_split: str | None = None
    """A split to validate on (e.g. test); None holds out val_split_fraction of the training split."""
    revision: str | None = None
    """A branch, tag or commit of a hub dataset; default its main branch."""
    data_files: list[str] | None = None
    """Only these files (glob patterns) of the dataset, e.g. ["0625/*.parquet"]."""
    streaming: bool = False
    """Refused: batches are planned from every sample's length (see the message), so the set is prepared
    up front, into a memory-mapped cache of about 5 bytes a token."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.streaming:
            raise LitsftError(STREAMING_REFUSED)

    def sources(self) -> dict[str, tuple[str, Callable[..., Sequence[list[Message]]]]]:
        if "_sources" not in self.__dict__:  # loading is not free, even from the cache: once per instance
            if self.val_split and Path(self.path).is_file():
                raise LitsftError(
                    f"--data.val_split {self.val_split}: {self.path} is one file, one split; leave val_split "
                    "unset (val_split_fraction of it is held out) or pass a folder or dataset with that split"
                )
            record_format = self.record_format()
            splits = {"train": self.split, **({"val": self.val_split} if self.val_split else {})}
            self._sources = {}
            for role, split in splits.items():
                rows, rows_identity = self._load_split(split)
                identity = digest_of(
                    {
                        "rows": rows_identity,
                        "columns": rows.column_names,
                        "split": split,
                        "records": record_format.identity(),
                    }
                )
                where = f"{self.path}{f' ({self.name})' if self.name else ''} split {split}"
                read = partial(DatasetConversations, rows, where, record_format)
                self._sources[role] = (f"hf:{identity}", read)
        return self._sources

    def __getstate__(self) -> dict[str, Any]:
        # Loaded datasets stay with this process; another process loads them again from the cache.
        return {key: value for key, value in self.__dict__.items() if key != "_sources"}

    def _load_split(self, split: str) -> tuple[Any, Any]:
        """The rows of one split, with only the columns the record shapes read (a `ParquetRows` when the
        split's files are all parquet, else a `datasets.Dataset`), and what identifies them: the files
        (local: path, size, modification time; hub: URL at the commit) or `datasets`' fingerprint."""
        import tqdm

        # tqdm's monitor thread (started by the first progress bar) would make tokenizing start its workers
        # from a server process instead of forking them (samples.py); it only tunes bar refresh rates.
        tqdm.tqdm.monitor_interval = 0
        path = Path(self.path)
        try:
            if path.is_file() and path.suffix not in BUILDERS:
                raise LitsftError(
                    f"--data.path {path} is a {path.suffix or 'extensionless'} file; use a "
                    f"{', '.join(BUILDERS)} file or a folder of them"
                )
            if not (path.exists() or (_HUB_ID.fullmatch(self.path) and path.suffix not in BUILDERS)):
                raise LitsftError(
                    f"--data.path {self.path} is neither an existing file or folder nor a hub dataset id "
                    "(org/name); check the path"
                )
            saved_to_disk = path.is_dir() and _saved_to_disk(path)
            if path.is_dir() and not saved_to_disk:
                _check_one_file_type(path, self.data_files)
            parquet = None
            if READ_PARQUET_DIRECTLY and not saved_to_disk:
                parquet = parquet_split(self.path, self.name, self.revision, self.data_files, split)
            if parquet is not None and features_match(parquet):
                rows, identity = ParquetRows(parquet.files), parquet.identities
            else:  # other file types, or a card whose features `datasets` casts the columns to
                rows = self._load_with_datasets(split, saved_to_disk)
                identity = rows._fingerprint
        except Exception as err:
            if path.exists() and not isinstance(err, LitsftError):
                _check_local_files(path, self.data_files)  # names the file (and line) that broke the load
            raise _load_error(err, self.path, self.name, split) from None
        record_format = self.record_format()
        check_columns(rows.column_names, f"{self.path} split {split}", record_format)
        wanted = set(record_fields()) | set(record_format.field_map.values())
        return rows.select_columns([column for column in rows.column_names if column in wanted]), identity

    def _load_with_datasets(self, split: str, saved_to_disk: bool) -> Any:
        """The `datasets.Dataset` of one split (`saved_to_disk`: from a `save_to_disk` folder), converted by
        `datasets` into its arrow cache."""
        import datasets
        import pyarrow

        path = Path(self.path)
        if saved_to_disk:
            dataset = _pick_split(datasets.load_from_disk(str(path)), split, self.path)
        elif path.is_file():
            dataset = datasets.load_dataset(
                BUILDERS[path.suffix],
                data_files={split: str(path)},
                split=split,
                writer_batch_size=ARROW_BATCH_ROWS,
            )
        else:
            dataset = datasets.load_dataset(
                self.path,
                name=self.name,
                split=split,
                revision=self.revision,
                data_files=self.data_files,
                writer_batch_size=ARROW_BATCH_ROWS,
            )
        # Converting files into the arrow cache leaves arrow's allocator holding the buffers it freed (65 MB
        # of 174 MB of anonymous memory after loading 500k rows): give them back before tokenizing workers
        # are forked, each of which would count them again.
        pyarrow.default_memory_pool().release_unused()
        return dataset


class DatasetConversations(Sequence):
    """A dataset's rows (a `ParquetRows` or a `datasets.Dataset`) as conversations, converted a slice at a
    time (what tokenizing asks for)."""

    def __init__(
        self, dataset: Any, name: str, record_format: RecordFormat, limit: int | None = None
    ) -> None:
        self.dataset, self.name, self.record_format = dataset, name, record_format
        self.length = dataset.num_rows if limit is None else min(limit, dataset.num_rows)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, int):
            return self[index : index + 1][0]
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("DatasetConversations slices with step 1 only")
        columns = self.dataset[start:stop]  # {column: [values]}: one arrow read for the whole slice
        names = list(columns)
        return [
            self._conversation(dict(zip(names, values)), start + offset)
            for offset, values in enumerate(zip(*columns.values()))
        ]

    def _conversation(self, record: dict[str, Any], row: int) -> Conversation:
        return to_conversation(record, self.where(row), self.record_format)

    def where(self, index: int) -> str:
        """The dataset and row of conversation `index`, for error messages."""
        return f"{self.name} row {index}"


def _local_files(path: Path, data_files: list[str] | None) -> list[Path]:
    """The data files `datasets` may read from a local file or folder (all of them, or those `data_files`
    picks), hidden files and folders aside, as `datasets` leaves them aside."""
    if path.is_file():
        return [path]
    found = [file for pattern in data_files for file in path.glob(pattern)] if data_files else path.rglob("*")
    return sorted(
        file
        for file in found
        if file.is_file()
        and file.suffix in BUILDERS
        and not any(part.startswith((".", "_")) for part in file.relative_to(path).parts)
    )


def _check_one_file_type(folder: Path, data_files: list[str] | None) -> None:
    """`datasets` reads one file type of a folder and ignores the others (a folder of .parquet and .jsonl
    files trains on the parquet half, without a word): refuse a folder of several types."""
    builders: dict[str, list[str]] = {}
    for file in _local_files(folder, data_files):
        builders.setdefault(BUILDERS[file.suffix], []).append(file.suffix)
    if len(builders) > 1:
        types = ", ".join(sorted({suffix for suffixes in builders.values() for suffix in suffixes}))
        raise LitsftError(
            f"--data.path {folder} holds files of several types ({types}) and `datasets` would read only one "
            "type of them; convert them to one type, or pick one with --data.data_files, e.g. "
            "'[\"**/*.parquet\"]'"
        )


def _check_local_files(path: Path, data_files: list[str] | None) -> None:
    """After `datasets` failed on local files: read each file the way litsft reads it to name the one that
    is broken, and where (`datasets` says "An error occurred while generating the dataset")."""
    for file in _local_files(path, data_files):
        if file.stat().st_size == 0:
            raise LitsftError(f"{file} is empty (0 bytes); remove it or write it again")
        if file.suffix in (".json", ".jsonl"):
            # `datasets` reads a .json file that is not one list as JSON Lines. Raises naming the file and line.
            for _ in iter_records(file, lines=file.suffix == ".jsonl" or not _starts_a_list(file)):
                pass
        elif file.suffix == ".parquet":
            open_parquet(str(file))  # raises naming the file


def _starts_a_list(file: Path) -> bool:
    with open(file, "rb") as opened:
        return opened.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _saved_to_disk(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _pick_split(loaded: Any, split: str, path: str) -> Any:
    if not hasattr(loaded, "keys"):  # a single Dataset: it is the split asked for
        return loaded
    if split not in loaded:
        raise LitsftError(f"{path} has no split {split!r}; it has {', '.join(loaded)}; pass --data.split")
    return loaded[split]


def _load_error(err: Exception, path: str, name: str | None, split: str) -> Exception:
    """One line for a dataset that cannot be loaded, naming the fix."""
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub import constants

    if isinstance(err, LitsftError):
        return err
    message = _first_line(err)
    if isinstance(err, DatasetNotFoundError) and "gated" in message:
        return LitsftError(
            f"{path} is a gated dataset: accept its conditions on its dataset page, then set HF_TOKEN to a "
            "token of that account"
        )
    if isinstance(err, DatasetNotFoundError):
        return LitsftError(
            f"--data.path {path} is not a local path and {constants.ENDPOINT} has no dataset {path} (or it is "
            "private: set HF_TOKEN); check the name"
        )
    if constants.is_offline_mode() and isinstance(err, ConnectionError):
        config = f" (config {name})" if name else ""
        return LitsftError(
            f"HF_HUB_OFFLINE is set and {path}{config} was never loaded on this machine; load it once where "
            "the hub is reachable (the `datasets` cache in HF_HOME keeps it), or unset HF_HUB_OFFLINE"
        )
    if isinstance(err, ConnectionError):
        return LitsftError(
            f"cannot reach {constants.ENDPOINT} to load {path} ({message}); check the network (HF_ENDPOINT "
            "names a mirror) and run the same command again"
        )
    if isinstance(err, ValueError) and ("BuilderConfig" in message or "Config name" in message):
        return LitsftError(f"{path} has no config {name!r}: {message}; pass one of them as --data.name")
    if isinstance(err, ValueError) and "split" in message.lower():
        return LitsftError(f"{path} has no split {split!r}: {message}; pass --data.split")
    return LitsftError(f"loading {path} failed: {message}")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
