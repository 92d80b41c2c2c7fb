"""The model a command is given, as the litsft checkpoint it reads: a litsft checkpoint directory as is, a
Hugging Face model directory converted once into a cache, a step checkpoint of a training run opened once
into the cache as the final/ folder its run would have written at that step (`open_step_checkpoint`), or a
hub id (<org>/<name>) downloaded and converted into checkpoints/<org>/<name>.

A run's first process does the conversion or the download; the other ranks (torchrun or srun start them all
at once) wait until the checkpoint is published. Fabric's launcher resolves the model before it spawns the
node's other ranks, so they find it ready. One line on the first process says what the model was and where
its litsft checkpoint lives.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from litsft.checkpoint.checkpoint_dirs import is_step_checkpoint, out_dir_given_as_a_model, step_model_state
from litsft.errors import LitsftError
from litsft.model.config import CONFIG_FILENAME
from litsft.runtime import processes

WAIT_ENV = "LITSFT_MODEL_WAIT_S"
"""How long ranks other than the first wait for the first to download or convert the model (default 4 h)."""


def resolve_checkpoint(model: str | Path, quiet: bool = False) -> Path:
    """The litsft checkpoint directory for `model`: a litsft checkpoint, a Hugging Face model directory or a
    hub id. Every process of a run calls it; only the first one writes, and (unless `quiet`) reports on
    stdout, the run's log, what the model was."""
    path = Path(model)
    report = functools.partial(_report, quiet)
    if path.is_dir():
        if is_step_checkpoint(path):
            return _opened_step_checkpoint(path, report, adapters_allowed=False)
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
    _first_process_makes(checkpoint, lambda: download_checkpoint(str(model), checkpoint))
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


def open_step_checkpoint(path: str | Path, quiet: bool = False) -> Path:
    """`path` as it is, or for a step checkpoint (`out_dir/step-XXXXXXXX`) the folder its run would have
    written to final/ had it ended at that step: a litsft model folder, or finetune_lora's LoRA folder,
    written once into `$LITSFT_CACHE_DIR/converted` and reused while the checkpoint's files are unchanged.
    For the commands that read LoRA folders too (convert_to_hf, merge_lora, generate)."""
    path = Path(path)
    if not is_step_checkpoint(path):
        return path
    return _opened_step_checkpoint(path, functools.partial(_report, quiet), adapters_allowed=True)


def _opened_step_checkpoint(path: Path, report: Callable[[str], None], adapters_allowed: bool) -> Path:
    # Refuses an incomplete or damaged checkpoint in one line, before torch is imported or a weight read.
    state = step_model_state(path)
    recipe, step = state["recipe"], state.get("step")
    if recipe == "finetune_lora" and not adapters_allowed:
        raise LitsftError(
            f"{path} is a step checkpoint of a finetune_lora run: adapters over a base model, as its final/ "
            f"would be; fold them into a model folder first with `litsft merge_lora {path} --out_dir <dir>` "
            "and pass that dir here"
        )
    cache = conversion_cache_dir(path, sorted(p for p in path.rglob("*") if p.is_file()))
    if cache.is_dir():  # published whole with one rename: there, it is complete
        report(f"Model: step {step} of a {recipe} run, {path}, reusing its model in {cache}")
        return cache

    def write() -> None:
        from litsft.checkpoint.step_model import write_step_model
        from litsft.runtime.files import publish_atomically

        with publish_atomically(cache, f"the model of {path}") as staging:
            write_step_model(path, staging)

    _first_process_makes(cache, write)
    report(f"Model: step {step} of a {recipe} run, {path}, written once as a model into {cache}")
    return cache


def hf_conversion_cache_dir(hf_dir: Path) -> Path:
    """Where the litsft conversion of a Hugging Face directory is cached (`conversion_cache_dir` of its files)."""
    return conversion_cache_dir(hf_dir, sorted(p for p in Path(hf_dir).iterdir() if p.is_file()))


def conversion_cache_dir(source: Path, files: list[Path]) -> Path:
    """Where the litsft model converted from the folder `source` is cached: named after the folder and a
    fingerprint of its path and its `files`' names, sizes and modification times, so an edited or replaced
    source is converted again."""
    resolved = Path(source).resolve()
    fingerprint = hashlib.sha256(str(resolved).encode())
    for file in files:
        stat = file.stat()  # of the file a link points to: a hub snapshot's files link to its blobs
        fingerprint.update(f"{file.relative_to(source)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    root = Path(os.environ.get("LITSFT_CACHE_DIR", Path.home() / ".cache" / "litsft"))
    # A step checkpoint's folder name (step-00000100) says little without its run's: both name the cache.
    label = f"{resolved.parent.name}-{resolved.name}" if is_step_checkpoint(resolved) else resolved.name
    return root / "converted" / f"{label}-{fingerprint.hexdigest()[:16]}"


def _converted_hf_directory(hf_dir: Path, report: Callable[[str], None]) -> Path:
    cache = hf_conversion_cache_dir(hf_dir)
    if (cache / CONFIG_FILENAME).is_file():
        report(f"Model: Hugging Face directory {hf_dir}, reusing its litsft conversion in {cache}")
        return cache

    def convert() -> None:
        from litsft.huggingface.convert import convert_hf_directory

        convert_hf_directory(hf_dir, cache)

    _first_process_makes(cache, convert)
    report(f"Model: Hugging Face directory {hf_dir}, converted once into {cache}")
    return cache


def _first_process_makes(checkpoint: Path, make: Callable[[], object]) -> None:
    """Run `make` (which publishes `checkpoint`) on the run's first process; elsewhere wait for it."""
    if processes.is_first_process():
        try:
            make()
        except LitsftError:
            if not (checkpoint / CONFIG_FILENAME).is_file():
                raise
            # Another run published the same checkpoint first; its copy is as good as ours.
        return
    timeout_s = float(os.environ.get(WAIT_ENV, 4 * 3600))
    deadline = time.monotonic() + timeout_s
    while not (checkpoint / CONFIG_FILENAME).is_file():
        if time.monotonic() > deadline:
            raise LitsftError(
                f"waited {timeout_s:.0f} s for the first process to write {checkpoint}; if the nodes share no "
                f"filesystem, run `litsft download` or `litsft convert_from_hf` on each node first (or raise {WAIT_ENV})"
            )
        time.sleep(1)


def _report(quiet: bool, line: str) -> None:
    if not quiet and processes.is_first_process():
        print(line, flush=True)
