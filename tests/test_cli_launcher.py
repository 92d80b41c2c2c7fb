"""litsft/cli/launcher.py: a refused run is refused before its recipe is built (so before torch's model code and
Lightning are needed) and before out_dir is touched; a run that passes builds its recipe before the lock."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import write_records
from tiny_tokenizer import write_tiny_tokenizer

from litsft.cli.launcher import launch, rendezvous_watch, stop_at_once
from litsft.data import JSON
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.runtime.preemption import PreemptionFlag
from litsft.runtime.run_lock import LOCK_NAME, RunLock
from litsft.training.args import RunConfig, TrainConfig


class RecipeBuilt(Exception):
    """Raised by the recipe factory: the launch got as far as building the recipe."""


def build_recipe():
    raise RecipeBuilt


@pytest.fixture
def run(tmp_path: Path):
    write_tiny_tokenizer(tmp_path / "tokenizer")
    data = JSON(json_path=write_records(tmp_path / "data.json", count=8))
    yield RunConfig(
        Config.from_name("tiny-llama"), tmp_path / "tokenizer", data, tmp_path / "out", accelerator="cpu"
    )
    PreemptionFlag.uninstall()  # launch installs the signal handlers first


def test_a_refused_run_never_builds_its_recipe_nor_touches_out_dir(run: RunConfig) -> None:
    bad = RunConfig(
        run.config, run.tokenizer_dir, run.data, run.out_dir, accelerator="cpu", precision="16-mixed"
    )
    with pytest.raises(LitsftError, match="16-mixed needs a CUDA GPU"):
        launch("finetune_full", build_recipe, bad)
    indivisible = RunConfig(
        run.config,
        run.tokenizer_dir,
        run.data,
        run.out_dir,
        devices=3,
        accelerator="cpu",
        train=TrainConfig(),
    )
    with pytest.raises(LitsftError, match="global_batch_size=16 is not divisible"):
        launch("finetune_full", build_recipe, indivisible)
    assert not run.out_dir.exists()


def test_a_run_that_passes_builds_its_recipe_before_taking_the_lock(run: RunConfig) -> None:
    with pytest.raises(RecipeBuilt):
        launch("finetune_full", build_recipe, run)
    assert not (run.out_dir / LOCK_NAME).exists()


def test_stopping_at_once_frees_out_dir(run: RunConfig) -> None:
    class NoSpawn:
        strategy = None

    lock = RunLock(run.out_dir)
    lock.acquire()
    assert (run.out_dir / LOCK_NAME).exists()
    stop_at_once(NoSpawn(), lock)
    assert not (run.out_dir / LOCK_NAME).exists()


def test_one_process_has_no_rendezvous_to_watch(run: RunConfig) -> None:
    with rendezvous_watch(None, run, PreemptionFlag.install()) as watch:
        assert watch is None
