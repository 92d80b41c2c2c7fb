"""The model a command is given, as the litsft checkpoint it reads: a litsft checkpoint directory as is, a
Hugging Face model directory converted once into a cache, a step checkpoint of a training run opened once
into the cache as the final/ folder its run would have written at that step (litsft.checkpoint.model_cache), or a
hub id (<org>/<name>) downloaded and converted into checkpoints/<org>/<name>.

A run's first process does the conversion or the download; the other ranks (torchrun or srun start them all
at once) wait until the checkpoint is published. Fabric's launcher resolves the model before it spawns the
node's other ranks, so they find it ready. One line on the first process says what the model was and where
its litsft checkpoint lives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from litsft.checkpoint.checkpoint_dirs import is_step_checkpoint, out_dir_given_as_a_model
from litsft.checkpoint.model_cache import (
    conversion_cache_dir,
    first_process_makes,
    opened_step_checkpoint,
    report_model,
)
from litsft.errors import LitsftError
from litsft.model.config import CONFIG_FILENAME


def resolve_checkpoint(model: str | Path, quiet: bool = False) -> Path:
    """The litsft checkpoint directory for `model`: a litsft checkpoint, a Hugging Face model directory or a
    hub id. Every process of a run calls it; only the first one writes, and (unless `quiet`) reports on
    stdout, the run's log, what the model was."""
    path = Path(model)
    report = functools.partial(report_model, quiet)
    if path.is_dir():
        if is_step_checkpoint(path):
            return opened_step_checkpoint(path, report, adapters_allowed=False)
        if (path / CONFIG_FILENAME).is_file():
            report(f"Model: litsft checkpoint {path}")
            return path
        if (path / "config.json").is_file():
            return _converted_hf_directory(path, report)
        out_dir = out_dir_given_as_a_model(path)
        if out_dir is not None:
            raise LitsftError(out_dir)
        raise LitsftError(
            f"{path} is neither a litsft checkpoint ({CONFIG_FILENAME} is missing) nor a Hugging Face model "
            "directory (config.json is missing); pass a checkpoint directory or a hub id such as "
            "meta-llama/Llama-3.2-1B"
        )
    if str(model).startswith(("./", "../", "/", "~")):  # written as a path: never read as a hub id
        raise LitsftError(
            f"{model}: no such directory; pass an existing litsft checkpoint or Hugging Face model directory, "
            "or a hub id such as meta-llama/Llama-3.2-1B (without ./)"
        )
    from litsft.huggingface.hub import default_checkpoint_dir, download_checkpoint, is_converted, is_repo_id

    if not is_repo_id(str(model)) or path.exists():
        raise LitsftError(
            f"{model} does not exist; pass a litsft checkpoint directory, a Hugging Face model directory or a "
            "hub id such as meta-llama/Llama-3.2-1B"
        )
    checkpoint = default_checkpoint_dir(str(model))
    if is_converted(checkpoint):
        report(f"Model: hub id {model}, already downloaded and converted in {checkpoint}")
        return checkpoint
    # The token, if any, comes from HF_TOKEN (or `hf auth login`), which huggingface_hub reads itself.
    first_process_makes(checkpoint, lambda: download_checkpoint(str(model), checkpoint))
    report(f"Model: hub id {model}, downloaded and converted into {checkpoint}")
    return checkpoint


def local_model_dir(model: str | Path) -> Path | None:
    """The folder on disk that `resolve_checkpoint(model)` would read or convert (so its tokenizer can be
    read before anything is converted or downloaded); None for a hub id not downloaded yet."""
    path = Path(model)
    if path.is_dir():
        return path
    from litsft.huggingface.hub import default_checkpoint_dir, is_converted, is_repo_id

    if is_repo_id(str(model)) and is_converted(default_checkpoint_dir(str(model))):
        return default_checkpoint_dir(str(model))
    return None


def hf_conversion_cache_dir(hf_dir: Path) -> Path:
    """Where the litsft conversion of a Hugging Face directory is cached (`conversion_cache_dir` of its files)."""
    return conversion_cache_dir(hf_dir, sorted(p for p in Path(hf_dir).iterdir() if p.is_file()))


def _converted_hf_directory(hf_dir: Path, report: Callable[[str], None]) -> Path:
    cache = hf_conversion_cache_dir(hf_dir)
    if (cache / CONFIG_FILENAME).is_file():
        report(f"Model: Hugging Face directory {hf_dir}, reusing its litsft conversion in {cache}")
        return cache

    def convert() -> None:
        from litsft.huggingface.convert import convert_hf_directory

        convert_hf_directory(hf_dir, cache)

    first_process_makes(cache, convert)
    report(f"Model: Hugging Face directory {hf_dir}, converted once into {cache}")
    return cache
