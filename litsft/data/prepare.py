"""`litsft prepare`: tokenize a text corpus once, in parallel, into a litdata dataset."""

from __future__ import annotations

from pathlib import Path

from litsft.data.litdata_shards import optimize_text
from litsft.data.text import check_text_files, text_files
from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError


def prepare(
    input_dir: Path,
    out_dir: Path,
    checkpoint_dir: Path,
    val_fraction: float = 0.01,
    num_workers: int | None = None,
    chunk_bytes: str = "64MB",
) -> None:
    """Tokenize a corpus of .txt files into litdata shards, for `--data LitData --data.path <out_dir>`.

    Each file is one document (bos when the tokenizer adds it, eos at the end). Writes out_dir/train and,
    when val_fraction > 0 and there are two or more files, out_dir/val.

    Args:
        input_dir: A directory searched recursively for .txt files, or one .txt file.
        out_dir: Where the dataset is written; must not exist yet (nothing is overwritten).
        checkpoint_dir: The checkpoint whose tokenizer to use (its tokenizer.json and tokenizer_config.json).
        val_fraction: Share of the files held out for validation, chosen at the end of the sorted list.
        num_workers: Tokenizing processes; None: one per CPU.
        chunk_bytes: Size of each shard file.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise LitsftError(f"{out_dir} exists and is not empty; choose a new --out_dir or delete it")
    if not 0.0 <= val_fraction < 1.0:
        raise LitsftError(f"val_fraction={val_fraction} must be in [0, 1)")
    tokenizer = Tokenizer(checkpoint_dir)
    files = text_files(input_dir)
    check_text_files(files)
    num_val = int(val_fraction * len(files)) if len(files) > 1 else 0
    num_val = max(num_val, 1) if val_fraction > 0 and len(files) > 1 else num_val
    splits = {"train": files[: len(files) - num_val], "val": files[len(files) - num_val :]}
    for split, split_files in splits.items():
        if split_files:
            optimize_text(split_files, out_dir / split, tokenizer.checkpoint_dir, num_workers, chunk_bytes)
    print(f"wrote {out_dir}: {len(splits['train'])} training and {len(splits['val'])} validation files")
