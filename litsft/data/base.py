"""The data module interface the training engine calls, and its implementation for SFT records.

A recipe calls `data.check(tokenizer_dir)` first, before the model is converted and before any process
starts (the data opened and its first records read and rendered). The engine then calls, in this order:
    data.connect(tokenizer, max_seq_length, seed)      # every rank
    data.prepare()                                     # global rank 0 only, then a barrier
    data.setup()                                       # every rank
    loader = data.train_dataloader(rank, world_size, micro_batch_size, global_batch_size)
    val_loader = data.val_dataloader(rank, world_size, micro_batch_size)   # None: no validation data

Batches are dicts of CPU tensors: `input_ids` (B, T), `labels` (B, T) already shifted (`labels[:, t]`
follows `input_ids[:, :t + 1]`, -100 where there is no loss), `position_ids` (B, T), `row_lengths` (B,)
(the real tokens at the start of each row, right padding after them), and for packed batches
`document_ids` (B, T) (-1 on padding).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from litsft.data.chat import ChatFormat, Message, PromptStyle, TokenizeReport
from litsft.data.records import RecordFormat, RecordShape
from litsft.data.samples import (
    LengthCounts,
    Samples,
    count_lengths,
    tokenize_conversations,
    tokenize_to_cache,
    write_atomically,
)
from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError, check_number
from litsft.runtime.heap import release_freed_heap

CACHE_FORMAT_VERSION = 4
"""Part of every cache key: bump it when the cached layout or the tokenization rules change."""
CHECKED_RECORDS = 32
"""How many records of each split `check` reads and renders before launch."""


class Loader(Protocol):
    """What the engine iterates: one epoch per `for batch in loader`."""

    epoch: int

    def __iter__(self) -> Any: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DataModule:
    """Where the training data comes from and how it is batched (see the module docstring).

    Not a dataclass itself, so that jsonargparse offers its subclasses for `data: DataModule`.
    """

    num_workers: int
    seed: int | None
    cache_dir: Path | None

    def connect(self, tokenizer: Tokenizer, max_seq_length: int, seed: int) -> None:
        """Called first on every rank, before prepare and setup."""
        if max_seq_length < 1:
            raise LitsftError(f"max_seq_length={max_seq_length} must be at least 1")
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.data_seed = seed if self.seed is None else self.seed

    def prepare(self) -> None:
        """Download, check, tokenize and cache, on global rank 0 only (the engine then waits at a barrier)."""

    def setup(self) -> None:
        """Load what prepare cached, on every rank."""

    def train_dataloader(
        self, rank: int, world_size: int, micro_batch_size: int, global_batch_size: int
    ) -> Loader:
        raise NotImplementedError

    def val_dataloader(self, rank: int, world_size: int, micro_batch_size: int) -> Loader | None:
        """Every rank gets the same number of batches; None when there is no validation data."""
        return None

    def fingerprint(self) -> str | None:
        """A digest of the training data, recorded in checkpoints so that resuming with other data is
        refused; None when it cannot be known. Must not need `connect`: it is checked before launch."""
        return None

    def check(self, tokenizer_dir: Path | None) -> None:
        """Open the data and check what can be checked before the model is converted or downloaded and
        before any process starts (a bad dataset then fails in seconds, not after them): raise LitsftError
        for what training would fail on. `tokenizer_dir` is the model's tokenizer when it is on disk already.
        Must not need `connect`."""

    @property
    def cache_root(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        return Path(os.environ.get("LITSFT_CACHE_DIR", Path.home() / ".cache" / "litsft"))


@dataclass(kw_only=True)
class DataOptions:
    """Options every data module has."""

    num_workers: int = 0
    """Loader worker processes per rank; 0 builds batches in the training process."""
    seed: int | None = None
    """Seed of the data order and the validation split; None uses the run's seed."""
    cache_dir: Path | None = None
    """Where tokenized data is cached; default $LITSFT_CACHE_DIR or ~/.cache/litsft. User files are never written."""

    def __post_init__(self) -> None:
        check_number(
            "--data.num_workers", self.num_workers, at_least=0, fix="0 builds batches in the training process"
        )


@dataclass(kw_only=True)
class SFTDataModule(DataOptions, DataModule):
    """Conversations, rendered with a chat template, loss on the assistant replies."""

    packing: bool = True
    """Pack samples into rows of max_seq_length with per-document attention; False pads each batch to
    its longest sample and groups samples of similar length."""
    mask_prompt: bool = True
    """Only the assistant's tokens carry loss; False trains on every token (system and user too)."""
    prompt_style: PromptStyle | None = None
    """Format conversations with a named style; None uses the checkpoint's chat template (alpaca if it has none)."""
    val_split_fraction: float = 0.05
    """Share of the records held out for validation when there is no separate validation file."""
    skip_invalid: bool = True
    """Skip the records that cannot be trained on as they are (the chat template refuses them, a tool call
    is malformed), counted and the first reasons printed; false stops at the first such record instead."""

    tokenize_processes: int | None = None
    """Processes that tokenize the records when their cache is prepared (by rank 0 of a run, or by
    `litsft prepare`); None: one per core this process may run on, at most 16. Leaves the cache unchanged."""

    pairs = False  # not a dataclass field (no annotation): set by `train_pairs`, never on the command line
    """Whether the records are preference pairs (`train_pairs`)."""

    def train_pairs(self) -> None:
        """Read every record as a preference pair and deal pairs whole (litsft.data.pairs): what a
        preference objective trains on. Called by the recipe before `check`."""
        self.pairs = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("--data.tokenize_processes", self.tokenize_processes, at_least=1,
                     fix="leave it unset for one per core")  # fmt: skip
        check_number("--data.val_split_fraction", self.val_split_fraction, at_least=0, below=1,
                     fix="use e.g. 0.05, or 0 for no validation")  # fmt: skip

    def sources(self) -> dict[str, tuple[str, Callable[..., Sequence[list[Message]]]]]:
        """{"train": (identity, read), "val": ...}: a string that changes when the records change, and a
        function reading them, `read(limit=None)` (with a limit, only the first `limit` records). Without
        "val", val_split_fraction of the training records is held out."""
        raise NotImplementedError

    def check(self, tokenizer_dir: Path | None) -> None:
        """Each split opened (files, columns, the split itself), its first CHECKED_RECORDS records read as
        conversations (each record's shape detected), and, with the tokenizer, rendered with the chat
        template training uses: refused when none of them could be trained on, or the first that cannot
        when records are not skipped."""
        chat_format = None
        if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
            tokenizer = Tokenizer(tokenizer_dir)
            chat_format = ChatFormat(
                tokenizer, self.prompt_style, self.mask_prompt, skip_invalid=True, pairs=self.pairs
            )
        for split, (_, read) in self.sources().items():
            first = read(limit=CHECKED_RECORDS)
            if chat_format is None:
                continue
            _, report = tokenize_conversations(first, chat_format)
            if report.skipped and not self.skip_invalid:
                raise LitsftError(f"{report.skipped[0][1]} (--data.skip_invalid true skips such records)")
            if report.skipped and len(report.skipped) == report.conversations:
                raise LitsftError(
                    f"none of the first {report.conversations} {'training' if split == 'train' else split} "
                    "records can be trained on with the "
                    f"{chat_format.name} chat template; the first: {report.skipped[0][1]}"
                )

    def fingerprint(self) -> str | None:
        # The sources' identities change with the records (a file's contents, a generator's options).
        if "_fingerprint" not in self.__dict__:
            identities = {split: identity for split, (identity, _) in self.sources().items()}
            self._fingerprint = digest_of(identities)
        return self._fingerprint

    def connect(self, tokenizer: Tokenizer, max_seq_length: int, seed: int) -> None:
        super().connect(tokenizer, max_seq_length, seed)
        self.chat_format = ChatFormat(
            tokenizer, self.prompt_style, self.mask_prompt, self.skip_invalid, pairs=self.pairs
        )
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)

    def validation_prompts(self, count: int) -> list[list[int]]:
        """Token ids of the first `count` validation conversations up to their first reply (rendered with
        the chat template, ending with the assistant header), for the samples generated at validation."""
        if self.val_samples is None:
            return []
        if self.mask_prompt:
            # The tokens training saw, cut before the first loss target: the reply's first token.
            samples = self.val_samples
            return [
                samples.sample(i)[0][: samples.first_targets[i]].tolist()
                for i in range(min(count, len(samples)))
            ]
        # Every token is a target, so the prompt comes from the conversation: one sample per conversation.
        prompts = self.validation_conversations(count)
        return [self.chat_format.encode_prompt(messages) for messages in prompts]

    def validation_conversations(self, count: int) -> list[list[Message]]:
        """The messages of the first `count` validation conversations up to their first reply (the validation
        split's, else the held-out training records'); pairs of replies give none."""
        sources = self.sources()
        if "val" in sources:
            conversations = sources["val"][1]()
        else:
            train = sources["train"][1]()
            conversations = [train[int(i)] for i in self._held_out(len(train))[:count]]
        conversations = [messages for messages in conversations if isinstance(messages, list)]
        first_replies = (
            next((i for i, m in enumerate(messages) if m["role"] == "assistant"), 0)
            for messages in conversations
        )
        prompts = [messages[:i] for messages, i in zip(conversations, first_replies) if i > 0]
        return prompts[:count]

    def prepare(self) -> None:
        sources = self.sources()
        missing = {
            split: source
            for split, source in sources.items()
            if not (self._cached(source[0]) / "meta.json").is_file()
        }
        # Open (and so check) every split before tokenizing or writing anything.
        conversations = {split: read() for split, (_, read) in missing.items()}
        self._tokenized_in = {}
        for split, (identity, _) in missing.items():
            started = time.perf_counter()

            def tokenize(staging: Path, split: str = split) -> dict[str, Any]:
                report = tokenize_to_cache(
                    conversations[split],
                    self.chat_format,
                    staging,
                    f"Tokenizing the {split} records",
                    show_progress=True,
                    processes=self.tokenize_processes,
                )
                if report.conversations and len(report.skipped) == report.conversations:
                    raise LitsftError(
                        f"every {split} record was skipped as untrainable; the first: {report.skipped[0][1]}"
                    )
                # Memory-mapped: only the count is read, not one length per sample.
                samples = len(np.load(staging / "lengths.npy", mmap_mode="r", allow_pickle=False))
                return {"samples": samples, "left_out": left_out_summary(report)}

            write_atomically(self._cached(identity), tokenize, {"source": identity})
            self._tokenized_in[split] = time.perf_counter() - started
        self._report_prepared()

    def setup(self) -> None:
        self.train_samples, self.val_samples = self._load()
        release_freed_heap()  # what splitting and truncating freed: it would stay resident in every rank

    def train_dataloader(
        self, rank: int, world_size: int, micro_batch_size: int, global_batch_size: int
    ) -> Loader:
        loader = self._loader(self.train_samples, rank, world_size, micro_batch_size, global_batch_size)
        if len(loader) == 0:
            from litsft.data.loader import pack_rows

            positions = loader.positions
            rows = len(pack_rows(positions, np.arange(len(positions)), self.max_seq_length))
            count = (
                f"the {len(self.train_samples)} training samples fill {rows} packed rows, fewer than"
                if self.packing
                else (f"there are {len(self.train_samples)} training samples, fewer than")
            )
            raise LitsftError(
                f"{count} global_batch_size={global_batch_size}; lower global_batch_size or add data"
            )
        return loader

    def val_dataloader(self, rank: int, world_size: int, micro_batch_size: int) -> Loader | None:
        return self.ordered_dataloader("val", rank, world_size, micro_batch_size)

    def ordered_dataloader(
        self, split: str, rank: int, world_size: int, micro_batch_size: int
    ) -> Loader | None:
        """Every sample of a split ("train" or "val") once, in order, the last global batch filled with empty
        rows (every rank gets the same number of batches): validation, and the pass that scores each training
        sample for a preference objective's reference. None when the split is empty."""
        samples = self.train_samples if split == "train" else self.val_samples
        if samples is None or len(samples) == 0:
            return None
        return self._loader(
            samples, rank, world_size, micro_batch_size, world_size * micro_batch_size, shuffle=False
        )

    def _loader(
        self,
        samples: Samples,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        global_batch_size: int,
        shuffle: bool = True,
    ) -> Loader:
        # Imported here: the loader needs torch, and the CLI imports the data modules to parse --data.
        from litsft.data.loader import SFTLoader

        return SFTLoader(
            samples,
            self.max_seq_length,
            self.packing,
            self.tokenizer.pad_id,
            rank,
            world_size,
            micro_batch_size,
            global_batch_size,
            self.data_seed,
            self.num_workers,
            shuffle=shuffle,
            samples_per_unit=2 if self.pairs else 1,
        )

    # ---- cache -----------------------------------------------------------------------------------
    def _cached(self, identity: str) -> Path:
        key = {
            "version": CACHE_FORMAT_VERSION,
            "source": identity,
            "tokenizer": self.tokenizer_fingerprint,
            "template": self.chat_format.template,
            "mask_prompt": self.mask_prompt,
            "skip_invalid": self.skip_invalid,
        }
        if self.pairs:  # the same records tokenized as pairs (SFT keys stay what they were)
            key["pairs"] = True
        return self.cache_root / "sft" / digest_of(key)[:24]

    def _held_out(self, num_samples: int) -> np.ndarray:
        """The sorted indices of the training samples held out for validation (val_split_fraction)."""
        order = np.random.default_rng(self.data_seed).permutation(num_samples)
        return np.sort(order[: max(1, round(self.val_split_fraction * num_samples))])

    def _report_prepared(self) -> None:
        """What preparing ends with, for the run's log (prepare runs on rank 0 only), on every run of the
        data: what tokenizing left out, the training samples cut to max_seq_length or dropped, and one line
        per split. Counted from the cache entries' per-sample files a block at a time (`count_lengths`), not
        by loading them as setup does: 12 bytes a sample, which would add to preparing a large set's peak."""
        limit = self.max_seq_length + 1
        sources, counts, summaries = self.sources(), {}, []
        for split, (identity, _) in sources.items():
            entry = self._cached(identity)
            left_out = json.loads((entry / "meta.json").read_text())["left_out"]
            for line in left_out_notices(left_out, split):
                print(line, flush=True)
            counts[split] = count_lengths(entry, limit)
            seconds = getattr(self, "_tokenized_in", {}).get(split)
            line = prepared_line(split, counts[split], left_out, self.max_seq_length, seconds, self.pairs)
            summaries.append(line)
        if self.pairs:  # pairs are held out and truncated whole: counted as setup loads them
            for line in summaries:
                print(line, flush=True)
            train, _ = self._load()
            if self._truncation.notice(self.max_seq_length) is not None:
                print(self._truncation.notice(self.max_seq_length), flush=True)
            return
        train = counts["train"]
        if "val" not in sources and self.val_split_fraction > 0 and train.samples > 1:
            # The training samples left after holding out the validation ones (see _load).
            train = count_lengths(self._cached(sources["train"][0]), limit, self._held_out(train.samples))
        notice = truncation_notice(train, self.max_seq_length)
        if notice is not None:
            print(notice, flush=True)
        if train.without_target:
            print(dropped_notice(train.without_target, train.samples, self.max_seq_length), flush=True)
        if train.samples == train.without_target:
            raise LitsftError(no_training_sample(self.max_seq_length))
        for line in summaries:  # what preparing ends with, after what it left out and cut
            print(line, flush=True)

    def _load(self) -> tuple[Samples, Samples | None]:
        splits = {}
        for split, (identity, read) in self.sources().items():
            entry = self._cached(identity)
            # A rank that cannot see rank 0's cache (a node-local disk) tokenizes for itself.
            if (entry / "meta.json").is_file():
                splits[split] = Samples.load(entry)
            else:
                splits[split], _ = tokenize_conversations(read(), self.chat_format)
        train, val = splits["train"], splits.get("val")
        if self.pairs:
            return self._load_pairs(train, val)
        if val is None and self.val_split_fraction > 0 and len(train) > 1:
            held_out = self._held_out(len(train))
            kept = np.ones(len(train), dtype=bool)  # a mask: 1 byte a sample, not an 8-byte index
            kept[held_out] = False
            val, train = train.subset(held_out), train.subset(kept)
        train, _ = train.truncate(self.max_seq_length + 1)
        if val is not None:
            val, _ = val.truncate(self.max_seq_length + 1)
        if len(train) == 0:
            raise LitsftError(no_training_sample(self.max_seq_length))
        return train, val

    def _load_pairs(self, train: Samples, val: Samples | None) -> tuple[Samples, Samples | None]:
        """`_load` for preference pairs: held out and truncated a pair at a time (litsft.data.pairs)."""
        from litsft.data.pairs import pair_samples, truncate_pairs

        num_pairs = len(train) // 2
        if val is None and self.val_split_fraction > 0 and num_pairs > 1:
            held_out = self._held_out(num_pairs)
            kept = np.ones(num_pairs, dtype=bool)
            kept[held_out] = False
            val, train = train.subset(pair_samples(held_out)), train.subset(pair_samples(kept))
        train, self._truncation = truncate_pairs(train, self.max_seq_length)
        if val is not None:
            val, _ = truncate_pairs(val, self.max_seq_length)
        if len(train) == 0:
            raise LitsftError(
                f"no preference pair keeps a reply token within max_seq_length={self.max_seq_length}; "
                "raise max_seq_length"
            )
        return train, val


@dataclass(kw_only=True)
class RecordDataModule(SFTDataModule):
    """SFT data read from records (files, datasets), with how records become conversations (records.py)."""

    record_shape: RecordShape = "auto"
    """The records' shape: auto (detected per record), messages, sharegpt, alpaca, prompt_completion or text."""
    field_map: dict[str, str] | None = None
    """Field names of the standard shapes mapped to the data's own, e.g. {"instruction": "question",
    "output": "answer"} or {"conversations": "dialog"}."""
    role_map: dict[str, str] | None = None
    """ShareGPT `from` values mapped to roles (system, user, assistant, tool), added to the usual ones
    (human, gpt, system, tool, function...), e.g. {"bot": "assistant"}."""
    message_map: dict[str, str] | None = None
    """ShareGPT message keys, default {"role": "from", "content": "value"}."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.record_format()  # bad options fail when the command is parsed, not after a download

    def record_format(self) -> RecordFormat:
        return RecordFormat(
            shape=self.record_shape,
            field_map=dict(self.field_map or {}),
            role_map=dict(self.role_map or {}),
            message_map=dict(self.message_map or {}),
        )


SHOWN_REASONS = 3
"""How many reasons for skipped records the notice quotes."""


def left_out_summary(report: TokenizeReport) -> dict[str, Any]:
    """What tokenizing a split left out, as its cache entry keeps it (so that every run of it says so)."""
    return {
        "records": report.conversations,
        "skipped": len(report.skipped),
        "reasons": [problem for _, problem in report.skipped[:SHOWN_REASONS]],
        "opening_replies_dropped": report.opening_replies_dropped,
    }


def left_out_notices(left_out: dict[str, Any], split: str) -> list[str]:
    """The lines that tell the run's log what tokenizing a split left out (see left_out_summary)."""
    records = f"of {left_out['records']} {'training' if split == 'train' else split} records"
    lines = []
    if left_out["skipped"]:
        more = left_out["skipped"] - len(left_out["reasons"])
        lines.append(
            f"Skipped {left_out['skipped']} {records} that cannot be trained on as they are "
            f"(--data.skip_invalid false stops at the first instead): {'; '.join(left_out['reasons'])}"
            + (f"; and {more} more" if more else "")
        )
    if left_out["opening_replies_dropped"]:
        lines.append(
            f"{left_out['opening_replies_dropped']} {records} open with an assistant turn before any user "
            "message: it answers no prompt, so it is left out and the rest of the conversation is trained on"
        )
    return lines


def prepared_line(
    split: str,
    counts: LengthCounts,
    left_out: dict[str, Any],
    max_seq_length: int,
    seconds: float | None,
    pairs: bool = False,
) -> str:
    """The line that ends preparing a split: records, samples, tokens, truncated, skipped, and the time it
    took (or that it came from the cache). Preference pairs are counted as pairs, whose truncation (both
    samples together in max_seq_length) has a line of its own."""
    took = f"tokenized in {seconds:.1f} s" if seconds is not None else "read from the cache"
    if pairs:
        return (
            f"Prepared the {split} data: {left_out['records']:,} records, {counts.samples // 2:,} preference "
            f"pairs ({counts.samples:,} samples), {counts.tokens:,} tokens, {left_out['skipped']:,} skipped; {took}"
        )
    return (
        f"Prepared the {split} data: {left_out['records']:,} records, {counts.samples:,} samples, "
        f"{counts.tokens:,} tokens, {counts.longer:,} longer than max_seq_length={max_seq_length}, "
        f"{left_out['skipped']:,} skipped; {took}"
    )


def truncation_notice(train: LengthCounts, max_seq_length: int) -> str | None:
    """One line saying how many training samples are longer than a row and how many tokens they lose;
    None if none. `train` is counted against rows of max_seq_length + 1 tokens."""
    # A sample of max_seq_length + 1 tokens fills a row: inputs are its first max_seq_length, labels its last.
    if not train.longer:
        return None
    return (
        f"Truncated {train.longer} of {train.samples} training samples to max_seq_length={max_seq_length}: "
        f"{train.cut_tokens} tokens cut from their ends (at most {train.most_cut} from one, "
        f"{train.cut_tokens / train.longer:.0f} on average); raise --train.max_seq_length to train on them whole"
    )


def dropped_notice(dropped: int, samples: int, max_seq_length: int) -> str:
    """The training samples truncation drops, left without a target (a notice, not a Python warning)."""
    return (
        f"Dropped {dropped} of {samples} training samples: no assistant token is left "
        f"within max_seq_length={max_seq_length}; raise max_seq_length or shorten the prompts"
    )


def no_training_sample(max_seq_length: int) -> str:
    return (
        f"no training sample has an assistant token within max_seq_length={max_seq_length}; "
        "raise max_seq_length"
    )


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        path = tokenizer.checkpoint_dir / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()


def digest_of(value: Any) -> str:
    """SHA-256 of a JSON-serializable value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def file_fingerprint(path: Path) -> str:
    """Identity of a data file's contents, for cache keys."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return f"{Path(path).resolve()}:{digest.hexdigest()}"
