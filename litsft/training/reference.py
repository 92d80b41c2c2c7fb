"""The reference log-probabilities of objectives that compare the model with where it started (DPO, IPO):
each training and validation sequence scored once, in one no-grad pass, by the model training starts from,
before any step (with LoRA that is the base model: fresh adapters change nothing yet), and handed to the
loaders, whose batches carry each sequence's value (`reference_logps`). No second copy of the model is held
and no step pays a second forward pass.

The values are written to out_dir/reference_logps/ (rank 0, atomically) with what they were computed over;
a relaunch whose data and precision are the same reads them instead of scoring again. A resumed run would
score the same values anyway: this pass runs before a checkpoint's weights are loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric
from torch import nn

from litsft.runtime.files import write_json
from litsft.training.args import RunConfig
from litsft.training.objectives.preference import sequence_logps
from litsft.training.parallel import reshard
from litsft.training.step import sum_over_ranks, to_device

REFERENCE_DIR = "reference_logps"


def attach_reference(fabric: Fabric, model: nn.Module, run: RunConfig, loaders: dict[str, Any]) -> None:
    """Score every sample of each split whose loader is given ({"train": loader, "val": loader or None}) with
    `model` as it is now, or read the scores a previous launch of this run wrote, and give each loader
    its split's (`per_sample["reference_logps"]`). A collective: every rank calls it."""
    for split, loader in loaders.items():
        if loader is None:
            continue
        loader.per_sample["reference_logps"] = split_reference(fabric, model, run, split)


def split_reference(fabric: Fabric, model: nn.Module, run: RunConfig, split: str) -> np.ndarray:
    """One split's reference log-probability of each sample (float64, one per sample of the split)."""
    layout = run.layout
    ordered = run.data.ordered_dataloader(
        split, layout.data_rank(fabric.global_rank), layout.data_replicas, run.train.micro_batch_size
    )
    identity = {
        "split": split,
        "data": run.data.fingerprint(),
        "samples": digest(ordered.samples.lengths) + digest(ordered.samples.first_targets),
        "precision": str(run.precision),
    }
    path = run.out_dir / REFERENCE_DIR / f"{split}.npy"
    found = read_if_same(path, identity, len(ordered.samples))
    if found is not None:
        return found
    values = torch.zeros(len(ordered.samples), dtype=torch.float64, device=fabric.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in ordered:
            inputs = to_device(batch, fabric.device)
            logps = sequence_logps(model, inputs)
            index = inputs["sequence_samples"]
            real = index >= 0
            values.index_add_(0, index[real], logps[real].double())
    reshard(model)
    model.train(was_training)
    values = sum_over_ranks(fabric, values).cpu().numpy()  # each sample scored on one data replica
    if fabric.is_global_zero:
        write(path, values, identity)
    fabric.barrier()
    return values


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.int64).tobytes()).hexdigest()[:16]


def read_if_same(path: Path, identity: dict[str, Any], samples: int) -> np.ndarray | None:
    """The values at `path` when they were computed over the same samples (`identity`), else None."""
    meta = path.with_suffix(".json")
    if not (path.is_file() and meta.is_file()):
        return None
    try:
        if json.loads(meta.read_text()) != identity:
            return None
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return values if values.shape == (samples,) else None


def write(path: Path, values: np.ndarray, identity: dict[str, Any]) -> None:
    """The values and what they were computed over, each written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    with open(staging, "wb") as file:
        np.save(file, values, allow_pickle=False)
    staging.replace(path)
    write_json(path.with_suffix(".json"), identity)
