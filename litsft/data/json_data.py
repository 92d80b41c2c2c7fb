"""`--data JSON`: instruction or conversation records from .json / .jsonl files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from litsft.data.base import RecordDataModule, digest_of, file_fingerprint
from litsft.data.chat import Message
from litsft.data.json_files import EXTENSIONS, read_conversations
from litsft.errors import LitsftError


@dataclass(kw_only=True)
class JSON(RecordDataModule):
    """Records from a .json / .jsonl file, or from a directory holding train.json(l) and val.json(l).

    A record is OpenAI-style {"messages": [...]} (with tools and reasoning), ShareGPT {"conversations":
    [{"from", "value"}, ...]}, Alpaca {"instruction", "input", "output"}, {"prompt", "completion"} or
    {"text"}, detected per record or set with --data.record_shape; see litsft/data/records.py (the shapes)
    and litsft/data/json_files.py (reading the files).
    """

    json_path: Path
    """A .json or .jsonl file (val_split_fraction of it is held out for validation), or a directory
    with train.json(l) and, optionally, val.json(l)."""

    def sources(self) -> dict[str, tuple[str, Callable[..., list[list[Message]]]]]:
        path = Path(self.json_path)
        if path.is_dir():
            files = {split: self._find(path, split) for split in ("train", "val")}
            if files["train"] is None:
                raise LitsftError(
                    f"{path} has no train.json or train.jsonl; add one, or pass the file itself"
                )
        elif path.is_file():
            files = {"train": path}
        else:
            raise LitsftError(
                f"--data.json_path {path} does not exist; pass a .json/.jsonl file or a directory"
            )
        record_format = self.record_format()
        return {
            split: (
                file_fingerprint(file)
                if record_format.is_default
                else f"{file_fingerprint(file)}:{digest_of(record_format.identity())}",
                partial(read_conversations, file, record_format=record_format),
            )
            for split, file in files.items()
            if file is not None
        }

    @staticmethod
    def _find(directory: Path, split: str) -> Path | None:
        found = [directory / f"{split}{ext}" for ext in EXTENSIONS if (directory / f"{split}{ext}").is_file()]
        if len(found) > 1:
            raise LitsftError(f"{directory} has both {found[0].name} and {found[1].name}; keep one of them")
        return found[0] if found else None
