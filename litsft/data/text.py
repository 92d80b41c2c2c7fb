"""Pretraining data: plain text files tokenized into litdata shards (`--data TextFiles`), and any
litdata-optimized token dataset, local or remote (`--data LitData`), streamed in blocks.

A block is max_seq_length + 1 consecutive tokens of the token stream (documents end with eos); every
token is a target, and attention is plain causal across the block. The order comes from litdata: it
depends on the world size (chunks are dealt to ranks), so streaming runs with different world sizes see
different global batches, unlike SFT data (litsft/data/loader.py). Tokenizing text into litdata shards and
streaming them is litsft/data/litdata_shards.py's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from litsft.data.base import DataModule, DataOptions, Loader, digest_of, tokenizer_fingerprint
from litsft.data.step_geometry import StepGeometry
from litsft.errors import LitsftError, check_number

TEXT_EXTENSIONS = (".txt",)


class StreamingDataModule(DataModule):
    """Token datasets in litdata's optimized format, streamed in blocks of max_seq_length + 1 tokens."""

    def split_dir(self, split: str) -> str | None:
        """The optimized directory (local path or URL) of "train" or "val", or None when there is none."""
        raise NotImplementedError

    def train_dataloader(
        self, rank: int, world_size: int, micro_batch_size: int, global_batch_size: int
    ) -> Loader:
        StepGeometry.of(
            global_batch_size, micro_batch_size, world_size
        )  # refused before any data is streamed
        return self._loader("train", rank, world_size, micro_batch_size, shuffle=True)

    def val_dataloader(self, rank: int, world_size: int, micro_batch_size: int) -> Loader | None:
        return self._loader("val", rank, world_size, micro_batch_size, shuffle=False)

    def _loader(
        self, split: str, rank: int, world_size: int, micro_batch_size: int, shuffle: bool
    ) -> Loader | None:
        from litsft.data.litdata_shards import streaming_loader  # torch and litdata: only to train

        directory = self.split_dir(split)
        if directory is None:
            return None
        return streaming_loader(directory, self.max_seq_length, rank, world_size, micro_batch_size,
                                self.data_seed, self.num_workers, shuffle)  # fmt: skip


@dataclass(kw_only=True)
class LitData(DataOptions, StreamingDataModule):
    """A token dataset optimized with litdata (`litsft prepare`, or `litdata.optimize` with a
    TokensLoader), local or remote (s3://, gs://, ...), streamed."""

    path: str
    """The dataset: a directory with train/ and val/ inside, or one optimized directory (no validation)."""
    split_names: tuple[str, str] = ("train", "val")
    """Subdirectories of `path` holding the training and validation data."""

    def _split_dirs(self) -> tuple[str, str | None]:
        train, val = self.split_names
        local = "://" not in self.path
        if local and not Path(self.path).exists():
            raise LitsftError(f"--data.path {self.path} does not exist; create it with `litsft prepare`")
        if local and (Path(self.path) / "index.json").is_file():
            return self.path, None
        if local and not (Path(self.path) / train / "index.json").is_file():
            raise LitsftError(
                f"{self.path} holds no litdata dataset (no index.json, no {train}/index.json); "
                "create it with `litsft prepare` or point --data.path at an optimized directory"
            )
        val_dir = f"{self.path.rstrip('/')}/{val}"
        if local and not (Path(val_dir) / "index.json").is_file():
            val_dir = None
        return f"{self.path.rstrip('/')}/{train}", val_dir

    def split_dir(self, split: str) -> str | None:
        train, val = self._split_dirs()
        return train if split == "train" else val

    def fingerprint(self) -> str | None:
        train, _ = self._split_dirs()
        index = Path(train) / "index.json"
        return digest_of(index.read_text()) if index.is_file() else digest_of(train)


@dataclass(kw_only=True)
class TextFiles(DataOptions, StreamingDataModule):
    """Plain .txt files for pretraining: each file is a document. Tokenized once into litdata shards
    in the cache directory, then streamed."""

    train_data_path: Path
    """A .txt file or a directory searched recursively for .txt files."""
    val_data_path: Path | None = None
    """Validation files, like train_data_path; None holds out val_split_fraction of the training files."""
    val_split_fraction: float = 0.05
    """Share of the training files held out for validation (at least one, when there are two or more)."""
    tokenize_workers: int | None = None
    """Processes that tokenize the files; None: one per CPU."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("--data.val_split_fraction", self.val_split_fraction, at_least=0, below=1,
                     fix="use e.g. 0.05, or 0 for no validation")  # fmt: skip
        check_number(
            "--data.tokenize_workers", self.tokenize_workers, at_least=1, fix="pass null for one per CPU"
        )

    def splits(self) -> dict[str, list[Path]]:
        train = text_files(self.train_data_path)
        if self.val_data_path is not None:
            return {"train": train, "val": text_files(self.val_data_path)}
        if len(train) < 2 or self.val_split_fraction <= 0:
            return {"train": train}
        shuffled = random.Random(self.data_seed).sample(train, len(train))
        num_val = min(len(train) - 1, max(1, math.floor(self.val_split_fraction * len(train))))
        return {"train": sorted(shuffled[num_val:]), "val": sorted(shuffled[:num_val])}

    def fingerprint(self) -> str | None:
        # Every file named, before validation files are held out: the split needs the run's seed, which
        # `connect` brings, and a resume is checked before that. Path, size and modification time: hashing
        # a pretraining corpus at every start would take minutes.
        paths = [self.train_data_path, self.val_data_path]
        files = [file for path in paths if path is not None for file in text_files(path)]
        return digest_of(
            [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
        )

    def optimized_dir(self, split: str, files: list[Path]) -> Path:
        key = {
            "files": [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files],
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
        }
        return self.cache_root / "text" / digest_of(key)[:24] / split

    def prepare(self) -> None:
        splits = self.splits()
        for files in splits.values():
            check_text_files(files)
        for split, files in splits.items():
            out = self.optimized_dir(split, files)
            if not (out / "index.json").is_file():
                from litsft.data.litdata_shards import optimize_text  # torch and litdata: only to train

                optimize_text(files, out, self.tokenizer.checkpoint_dir, self.tokenize_workers)

    def setup(self) -> None:
        for split, files in self.splits().items():
            if not (self.optimized_dir(split, files) / "index.json").is_file():
                raise LitsftError(
                    f"the tokenized {split} data is missing from {self.optimized_dir(split, files)}; run "
                    "prepare() on rank 0 first, with a cache_dir that every node can read"
                )

    def split_dir(self, split: str) -> str | None:
        files = self.splits().get(split)
        return None if files is None else str(self.optimized_dir(split, files))


def text_files(path: Path) -> list[Path]:
    """A .txt file, or the .txt files under a directory, sorted."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_EXTENSIONS and p.is_file())
    else:
        raise LitsftError(f"{path} does not exist; pass a .txt file or a directory of .txt files")
    if not files:
        raise LitsftError(f"{path} holds no .txt files; add some, or point at the directory that has them")
    return files


def check_text_files(files: list[Path]) -> None:
    """Fail before tokenizing anything on an empty or non-UTF-8 file, naming the file and line."""
    for path in files:
        empty = True
        with open(path, "rb") as file:
            for number, line in enumerate(file, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise LitsftError(
                        f"{path} line {number}: byte 0x{line[err.start]:02x} is not valid UTF-8; "
                        "re-encode the file as UTF-8"
                    ) from None
                empty = empty and not line.strip()
        if empty:
            raise LitsftError(f"{path} is empty; remove it or add text")
