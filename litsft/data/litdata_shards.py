"""Token datasets in litdata's format: text files tokenized into shards in parallel (`optimize_text`), and
shards streamed as litsft batches of max_seq_length + 1 consecutive tokens (`StreamingLoader`).

The data modules that use them (litsft/data/text.py) import this module only to prepare or load data: it
imports torch and litdata, which the CLI does not need to parse `--data`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from litsft.data.samples import CACHE_FIX
from litsft.data.tokenizer import Tokenizer
from litsft.runtime.files import publish_atomically

RANGE_BYTES = 16 * 2**20
"""Large files are cut at line ends into pieces of about this size, tokenized in parallel."""


class StreamingLoader:
    """A litdata StreamingDataLoader giving litsft batches, with its state saved and restored.

    `len(loader)` is litdata's count of micro-batches per rank for one epoch.
    """

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader
        self.epoch = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for block in self.dataloader:
            block = block.long()  # (B, T + 1)
            input_ids = block[:, :-1]
            yield {
                "input_ids": input_ids,
                "labels": block[:, 1:],
                "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous(),
            }

    def __len__(self) -> int:
        return len(self.dataloader)

    def set_epoch(self, epoch: int) -> None:
        # litdata starts its next epoch (a new shuffle) by itself each time it is iterated.
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "streaming": self.dataloader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.dataloader.load_state_dict(state["streaming"])


def streaming_loader(
    input_dir: str,
    max_seq_length: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    num_workers: int,
    shuffle: bool,
) -> StreamingLoader:
    from litdata.streaming import StreamingDataLoader, StreamingDataset, TokensLoader
    from litdata.utilities.env import _DistributedEnv

    dataset = StreamingDataset(
        input_dir=input_dir,
        item_loader=TokensLoader(block_size=max_seq_length + 1),
        shuffle=shuffle,
        drop_last=True,
        seed=seed,
    )
    # The engine says which rank this is; litdata would otherwise guess from the environment.
    dataset.distributed_env = _DistributedEnv(world_size=world_size, global_rank=rank, num_nodes=1)
    dataset.drop_last = True  # every rank the same number of batches, or collectives would hang
    dataloader = StreamingDataLoader(
        dataset, batch_size=micro_batch_size, num_workers=num_workers, drop_last=True
    )
    return StreamingLoader(dataloader)


def byte_ranges(files: list[Path], range_bytes: int = RANGE_BYTES) -> list[tuple[str, int, int, bool]]:
    """(file, start, end, is_last_piece) pieces of about range_bytes, cut after a newline."""
    pieces = []
    for path in files:
        size = path.stat().st_size
        start = 0
        with open(path, "rb") as file:
            while start < size:
                end = min(start + range_bytes, size)
                if end < size:
                    file.seek(end)
                    end += len(file.readline())  # to the end of that line
                pieces.append((str(path), start, end, end >= size))
                start = end
    return pieces


_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenize_piece(piece: tuple[str, int, int, bool], checkpoint_dir: str) -> torch.Tensor:
    """The tokens of one piece of a file: bos before a file's first piece (when the tokenizer adds
    bos), eos after its last, so every file is one document."""
    tokenizer = _TOKENIZERS.get(checkpoint_dir) or _TOKENIZERS.setdefault(
        checkpoint_dir, Tokenizer(checkpoint_dir)
    )
    path, start, end, is_last = piece
    with open(path, "rb") as file:
        file.seek(start)
        text = file.read(end - start).decode("utf-8")
    ids = tokenizer.encode(text, add_bos=tokenizer.add_bos and start == 0, add_eos=is_last)
    dtype = torch.int32 if tokenizer.vocab_size < 2**31 else torch.int64
    return torch.tensor(ids, dtype=dtype)


def optimize_text(
    files: list[Path],
    out_dir: Path,
    checkpoint_dir: Path,
    num_workers: int | None = None,
    chunk_bytes: str = "64MB",
) -> None:
    """Tokenize `files` into a litdata token dataset at `out_dir`, in parallel processes with a progress
    bar. Written into a temporary sibling and renamed, so an interrupted run leaves nothing to trust."""
    from litdata import TokensLoader, optimize

    pieces = byte_ranges(files)
    num_workers = max(1, min(num_workers or os.cpu_count() or 1, len(pieces)))
    # litdata's own output (an advertisement, a line per worker and per stage) is turned off for this one.
    print(f"Tokenizing {_count(len(files), 'text file')} into {out_dir} with {_count(num_workers, 'process')}",
          flush=True)  # fmt: skip
    with publish_atomically(out_dir, "the tokenized text", fix=CACHE_FIX) as staging:
        optimize(
            fn=partial(tokenize_piece, checkpoint_dir=str(checkpoint_dir)),
            inputs=pieces,
            output_dir=str(staging),
            num_workers=num_workers,
            chunk_bytes=chunk_bytes,
            item_loader=TokensLoader(),
            # Each worker tokenizes a fixed, consecutive slice of the pieces, and the chunks are indexed in
            # worker order: the stream is the files in order, every file one whole document, the same on
            # every run. (litdata's default shares a queue: pieces land in whichever worker is free.)
            reorder_files=False,
            keep_data_ordered=True,
            start_method="fork" if "fork" in _start_methods() else None,
            verbose=False,
        )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "es" if noun.endswith("s") else "s")


def _start_methods() -> list[str]:
    import multiprocessing

    return multiprocessing.get_all_start_methods()
