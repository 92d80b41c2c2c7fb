"""litsft/training/checkpointer.py: a TrainState saved and loaded back is the same state (step, epoch, weights, optimizer,
loader position, random streams), and the run's identity is recorded for the checks before resuming."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launch import on_ranks, write_records, write_tiny_checkpoint
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

from litsft.checkpoint.checkpoint_dirs import TRAINER_STATE
from litsft.checkpoint.model_folder import read_manifest
from litsft.data import JSON
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer
from litsft.training.args import OptimizerConfig, RunConfig, TrainConfig
from litsft.training.checkpointer import FROZEN_FINGERPRINT, Checkpointer, TrainState, background_saves_fit
from litsft.training.optimizer import build_optimizer
from litsft.training.step import loss_scaler, train_step


class Loader:
    """The loader calls a TrainState makes: its position is its state."""

    def __init__(self, position: int = 0) -> None:
        self.position, self.epoch = position, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def train_state(fabric: Fabric, seed: int, position: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = Transformer(Config.from_name("tiny-llama"))
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-2)))
    model(torch.randint(0, 512, (1, 8))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return TrainState(model, optimizer, Loader(position))


@pytest.fixture
def checkpointer(tmp_path: Path) -> tuple[Fabric, Checkpointer]:
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    data = JSON(json_path=write_records(tmp_path / "data.json", count=8))
    run = RunConfig(
        Config.from_name("tiny-llama"), None, data, tmp_path / "out", seed=7, cli_arguments={"seed": 7}
    )
    return fabric, Checkpointer(fabric, run, "finetune_full", save_frozen=True)


def test_a_train_state_round_trips_through_a_checkpoint(checkpointer) -> None:
    fabric, saver = checkpointer
    state = train_state(fabric, seed=0, position=13)
    state.step, state.epoch = 5, 2
    path = saver.save(state)
    after_save = torch.rand(4)  # the random stream goes on from where the checkpoint was taken

    restored = train_state(fabric, seed=1)
    saver.load(path, restored)
    assert (restored.step, restored.epoch, restored.train_loader.state_dict()) == (5, 2, {"position": 13})
    assert restored.train_loader.epoch == 2
    assert torch.equal(torch.rand(4), after_save)
    for (name, a), b in zip(state.model.named_parameters(), restored.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(state.optimizer.param_groups[0]["params"], restored.optimizer.param_groups[0]["params"]):
        assert torch.equal(state.optimizer.state[a]["exp_avg"], restored.optimizer.state[b]["exp_avg"])


def test_a_checkpoint_records_what_the_checks_before_resuming_compare(checkpointer) -> None:
    fabric, saver = checkpointer
    path = saver.save(train_state(fabric, seed=0))
    recorded = json.loads((path / TRAINER_STATE).read_text())
    assert recorded["recipe"] == "finetune_full" and recorded["seed"] == 7
    assert recorded["data"] == saver.run.data.fingerprint() and recorded["data"]
    assert recorded["config"]["hidden_size"] == Config.from_name("tiny-llama").hidden_size
    assert recorded["arguments"] == {"seed": 7}


def test_a_resume_over_other_frozen_base_weights_is_refused_in_one_line(tmp_path: Path) -> None:
    """LoRA's checkpoints leave the frozen base out: resuming them over other base weights of the same shape
    would continue the adapters on a model they were not trained on, so the base's fingerprint is recorded
    and compared."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    data = JSON(json_path=write_records(tmp_path / "data.json", count=8))
    run = RunConfig(Config.from_name("tiny-llama"), None, data, tmp_path / "out", seed=7, cli_arguments={})
    base, other = write_tiny_checkpoint(tmp_path / "base"), write_tiny_checkpoint(tmp_path / "other", seed=1)
    saver = Checkpointer(fabric, run, "finetune_lora", save_frozen=False, frozen_base=base)
    path = saver.save(train_state(fabric, seed=0))
    recorded = json.loads((path / TRAINER_STATE).read_text())[FROZEN_FINGERPRINT]
    assert recorded == read_manifest(base)["weights_sha256"] != read_manifest(other)["weights_sha256"]

    Checkpointer(fabric, run, "finetune_lora", save_frozen=False, frozen_base=base).load(
        path, train_state(fabric, seed=1)
    )
    over_other = Checkpointer(fabric, run, "finetune_lora", save_frozen=False, frozen_base=other)
    with pytest.raises(LitsftError) as refused:
        over_other.load(path, train_state(fabric, seed=1))
    assert str(refused.value) == (
        f"{path} was trained over other frozen base weights than {other} holds (fingerprint "
        f"{read_manifest(other)['weights_sha256'][:12]}, recorded {recorded[:12]}); resume with the base "
        "checkpoint it was trained over, or pass another --out_dir to start over"
    )


def test_another_number_of_ranks_reseeds_the_random_streams(checkpointer) -> None:
    """The rank files of a checkpoint written by 2 processes do not fit 1: rank 0's data position is used
    and the random streams start from a seed derived from the run's seed and the step."""
    fabric, saver = checkpointer
    state = train_state(fabric, seed=0, position=3)
    state.step = 4
    path = saver.save(state)
    recorded = json.loads((path / TRAINER_STATE).read_text())
    (path / TRAINER_STATE).write_text(json.dumps({**recorded, "world_size": 2}))
    restored = train_state(fabric, seed=1)
    saver.load(path, restored)
    assert (restored.step, restored.train_loader.position) == (4, 3)
    reseeded = torch.rand(4)
    torch.manual_seed(7 + 4 * 7919)  # --seed 7, step 4, rank 0
    assert torch.equal(reseeded, torch.rand(4))


def _16_mixed_run(out_dir: Path, steps: range, resume_from: Path | None = None) -> tuple[TrainState, Path]:
    """Optimizer steps `steps` of a tiny model under fp16 autocast with a loss scaler (Fabric's 16-mixed, on the
    CPU), from a fresh start or from `resume_from`; the checkpoint of the last step is saved and returned. The
    scaler starts far too high and backs off hard: step 1 overflows and sets the scale to 2**8."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-32, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    out_dir.mkdir(exist_ok=True)
    data = JSON(json_path=write_records(out_dir / "data.json", count=8))
    run = RunConfig(Config.from_name("tiny-llama"), None, data, out_dir, seed=7, cli_arguments={})
    saver = Checkpointer(fabric, run, "finetune_full", save_frozen=True)
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-3)))
    state = TrainState(model, optimizer, Loader(), loss_scaler=loss_scaler(fabric))
    if resume_from is not None:
        saver.load(resume_from, state)
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        batch = {
            name: torch.randint(0, 512, (2, 16), generator=generator) for name in ("input_ids", "labels")
        }
        train_step(fabric, model, optimizer, [batch], max_norm=1.0)
        state.step = step
    return state, saver.save(state)


def test_16_mixed_resumes_with_the_loss_scale_it_had(tmp_path: Path) -> None:
    """Under 16-mixed the loss scale is part of the train state: a run resumed after step 2 makes the same
    updates as the uninterrupted one, bit for bit. Without it the resumed scaler starts again at its initial
    scale, its first step overflows and is skipped, and the runs part."""
    uninterrupted, _ = _16_mixed_run(tmp_path / "uninterrupted", range(1, 5))
    _, step_2 = _16_mixed_run(tmp_path / "interrupted", range(1, 3))
    resumed, _ = _16_mixed_run(tmp_path / "interrupted", range(3, 5), resume_from=step_2)
    assert resumed.loss_scaler.get_scale() == uninterrupted.loss_scaler.get_scale() == 2.0**11
    for (name, a), b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_background_saves_need_half_the_available_memory_free_of_the_nodes_copies() -> None:
    assert background_saves_fit(10 * 10**9, 8, 160 * 10**9) is None  # 80 GB of copies, 160 GB available
    assert background_saves_fit(10 * 10**9, 8, None) is None  # the system does not say: as asked
    assert background_saves_fit(10 * 10**9, 8, 150 * 10**9) == (
        "a background save would keep 80.0 GB of host memory (8 x 10.0 GB) and 150.0 GB is available"
    )


def test_on_the_cpu_checkpoints_are_written_synchronously_unless_asked(checkpointer) -> None:
    fabric, saver = checkpointer
    run = dataclasses.replace(saver.run, train=TrainConfig(save_interval=1))
    saver = Checkpointer(fabric, run, "finetune_full", save_frozen=True)
    assert run.train.async_save is None and not saver.in_background
    saver.save(train_state(fabric, seed=0))
    assert saver.pending is None
    asked = Checkpointer(
        fabric, dataclasses.replace(run, train=TrainConfig(save_interval=1, async_save=True)), "x", True
    )
    state = train_state(fabric, seed=0)
    state.step = 1
    asked.save(state)
    assert asked.pending is not None
    asked.close()
    assert asked.pending is None


def _gpu_default_decided_with(available: dict[int, int]) -> tuple[bool, list[str]]:
    """A GPU run's Checkpointer (async_save left unset, 2 processes on the node) deciding at its first save,
    each rank seeing `available[rank]` bytes of host memory."""
    import torch.distributed as dist

    from litsft.training import checkpointer as module

    rank = dist.get_rank()
    module.available_host_memory = lambda: available[rank]  # this forked rank's own module
    printed: list[str] = []
    fabric = SimpleNamespace(
        device=torch.device("cuda"), world_size=2, global_rank=rank, print=printed.append
    )
    config = Config.from_name("tiny-llama")
    run = RunConfig(config, None, None, Path("out"), devices=2, train=TrainConfig(save_interval=10))
    saver = Checkpointer(fabric, run, "finetune_full", True)
    assert saver.in_background and saver.background_group is not None
    without_step_checkpoints = Checkpointer(
        fabric, dataclasses.replace(run, train=TrainConfig()), "pretrain", True
    )
    assert not without_step_checkpoints.in_background and without_step_checkpoints.background_group is None
    model = Transformer(config)
    optimizer = build_optimizer(model, OptimizerConfig())
    state = TrainState(SimpleNamespace(module=model), optimizer, Loader())
    return saver._background_saves_fit(state), printed


def test_one_node_short_of_memory_makes_every_rank_save_synchronously_and_says_why(tmp_path: Path) -> None:
    plenty = 100 * 10**9
    for decided, printed in on_ranks(2, _gpu_default_decided_with, tmp_path, {0: plenty, 1: plenty}).values():
        assert decided and not printed
    for decided, printed in on_ranks(2, _gpu_default_decided_with, tmp_path, {0: plenty, 1: 10**6}).values():
        assert not decided
        (notice,) = printed
        assert notice.startswith("Checkpoints are written synchronously: a background save would keep 0.")
        assert notice.endswith(
            "and 0.0 GB is available (rank 1); --train.async_save true writes them in the background anyway"
        )
