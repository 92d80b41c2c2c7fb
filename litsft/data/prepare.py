"""`litsft prepare`: tokenize a text corpus once, in parallel, into a litdata dataset; `litsft prepare_sft`:
tokenize SFT records once into the data cache a training run reads, and show samples as training sees them."""

from __future__ import annotations

from pathlib import Path

from litsft.data.base import DataModule, SFTDataModule
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


LOSS_OPEN, LOSS_CLOSE = "\u2039", "\u203a"
"""Marks around the text of the tokens that carry loss in `prepare_sft --show_samples`: ‹ and ›."""


def prepare_sft(
    checkpoint_dir: Path,
    data: DataModule | None = None,
    max_seq_length: int = 2048,
    seed: int = 1337,
    show_samples: int = 0,
    pairs: bool = False,
) -> None:
    """Tokenize SFT records into the data cache once (on a CPU node, before a GPU job) and show samples.

    Takes the model and `--data` options a recipe takes: a training run with the same data, tokenizer and
    `--data.cache_dir` finds the cache and starts at once. Tokenizes on every core, with a progress bar, and
    ends with one line per split: records, samples, tokens, those longer than max_seq_length, skipped, time.

    Args:
        checkpoint_dir: The checkpoint whose tokenizer and chat template to use.
        data: The SFT data, as a recipe's --data (e.g. --data HFDataset --data.path BAAI/Infinity-Instruct).
        max_seq_length: The training run's max_seq_length: samples are cut to it, as training cuts them.
        seed: The training run's seed (or --data.seed): which records are held out for validation.
        show_samples: Print the first this-many training samples as rendered, with the text of the tokens
            that carry loss between ‹ and ›; preference pairs both halves, chosen and rejected.
        pairs: Read the records as preference pairs ('chosen' and 'rejected'), as a run with a preference
            objective (--objective.name dpo, ipo, simpo or orpo) does, and cache them for it.
    """
    if not isinstance(data, SFTDataModule):
        given = f"--data {type(data).__name__} is not SFT data" if data is not None else "no data given"
        raise LitsftError(
            f"{given}; prepare_sft takes --data JSON, HFDataset or Demo (`litsft prepare` tokenizes text files "
            "for pretraining)"
        )
    if show_samples < 0:
        raise LitsftError(f"--show_samples={show_samples} must be at least 0")
    if pairs:
        data.train_pairs()
    data.check(Path(checkpoint_dir))
    data.connect(Tokenizer(checkpoint_dir), max_seq_length, seed)
    data.prepare()
    if show_samples:
        data.setup()
        samples = data.train_samples
        shown = min(show_samples * 2 if pairs else show_samples, len(samples))
        for index in range(shown):
            tokens, targets = samples.sample(index)
            name = f"training sample {index + 1} of {len(samples):,}"
            if pairs:
                half = "rejected" if index % 2 else "chosen"
                name = f"training pair {index // 2 + 1} of {len(samples) // 2:,}, {half}"
            print(
                f"--- {name}: {len(tokens)} tokens, "
                f"{int(targets[1:].sum())} carry loss (between {LOSS_OPEN} and {LOSS_CLOSE}) ---"
            )
            print(marked_text(data.tokenizer, tokens.tolist(), targets.tolist()))


def marked_text(tokenizer: Tokenizer, tokens: list[int], targets: list[bool]) -> str:
    """The text of `tokens`, each run of tokens that carry loss between LOSS_OPEN and LOSS_CLOSE (the first
    token never does: nothing precedes it)."""
    targets = [False, *targets[1:]]
    pieces, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or targets[end] != targets[start]:
            text = tokenizer.decode(tokens[start:end], skip_special_tokens=False)
            pieces.append(f"{LOSS_OPEN}{text}{LOSS_CLOSE}" if targets[start] else text)
            start = end
    return "".join(pieces)
