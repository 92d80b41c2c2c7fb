"""The cache of litsft models made from other folders (`$LITSFT_CACHE_DIR/converted`): where the model of a
folder goes, a step checkpoint of a training run opened once as the model its run would have written to
final/ at that step (`open_step_checkpoint`), and the rule that a run's first process makes a cached model
while the other ranks wait for it to be published (torchrun or srun start them all at once).
Hugging Face folders are converted into the same cache by litsft.huggingface.model_source.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from litsft.checkpoint.checkpoint_dirs import is_step_checkpoint, step_model_state
from litsft.errors import LitsftError
from litsft.model.config import CONFIG_FILENAME
from litsft.runtime import processes

WAIT_ENV = "LITSFT_MODEL_WAIT_S"
"""How long ranks other than the first wait for the first to download or convert the model (default 4 h)."""


def open_step_checkpoint(path: str | Path, quiet: bool = False) -> Path:
    """`path` as it is, or for a step checkpoint (`out_dir/step-XXXXXXXX`) the folder its run would have
    written to final/ had it ended at that step: a litsft model folder, or finetune_lora's LoRA folder,
    written once into `$LITSFT_CACHE_DIR/converted` and reused while the checkpoint's files are unchanged.
    For the commands that read LoRA folders too (convert_to_hf, merge_lora, generate)."""
    path = Path(path)
    if not is_step_checkpoint(path):
        return path
    return opened_step_checkpoint(path, functools.partial(report_model, quiet), adapters_allowed=True)


def opened_step_checkpoint(path: Path, report: Callable[[str], None], adapters_allowed: bool) -> Path:
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

    first_process_makes(cache, write)
    report(f"Model: step {step} of a {recipe} run, {path}, written once as a model into {cache}")
    return cache


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


def first_process_makes(checkpoint: Path, make: Callable[[], object]) -> None:
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


def report_model(quiet: bool, line: str) -> None:
    if not quiet and processes.is_first_process():
        print(line, flush=True)
