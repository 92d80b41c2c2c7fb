"""litsft/checkpoint/training_checkpoint.py: what a step checkpoint holds on disk (read back by checkpoint_dirs.py,
whose own tests on plain directories are in tests/test_checkpoint_checkpoint_dirs.py), its atomic publication,
loading it back, rotation, leftovers, and refusing pickled objects."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

from litsft.checkpoint.checkpoint_dirs import (
    TRAINER_STATE,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    read_trainer_state,
)
from litsft.checkpoint.training_checkpoint import (
    load_rank_state,
    load_training_checkpoint,
    remove_partial_checkpoints,
    rotate_checkpoints,
    save_training_checkpoint,
)
from litsft.errors import LitsftError
from litsft.runtime.faults import FAULT_ENV


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model after two AdamW steps: parameters and both Adam moments differ from their start."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3, bias=False))
    model[2].weight.requires_grad_(False)  # a frozen parameter
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def save(out_dir, step: int, model, optimizer, save_frozen: bool = True):
    return save_training_checkpoint(
        out_dir,
        step,
        model,
        optimizer,
        {"recipe": "test", "epoch": 1},
        {"loader": {"position": 7}},
        save_frozen,
    )


def test_a_checkpoint_holds_its_files_listed_with_their_sizes(tmp_path) -> None:
    model, optimizer = trained(0)
    path = save(tmp_path, 12, model, optimizer)
    assert path == tmp_path / "step-00000012" == tmp_path / checkpoint_name(12)
    state = json.loads((path / TRAINER_STATE).read_text())
    assert state["files"] == ["rank-00000.pt", "shards/shard-00001-model-00001-of-00001.safetensors"]
    assert state["format"] == "dcp-safetensors"
    assert state["file_sizes"] == {name: (path / name).stat().st_size for name in state["files"]}
    assert (state["step"], state["world_size"], state["recipe"], state["epoch"]) == (12, 1, "test", 1)
    assert [group["params"] for group in state["param_groups"]] == [
        ["0.weight", "0.bias", "1.weight", "1.bias"]
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000012"]  # nothing partial left
    assert is_complete(path) and latest_checkpoint(tmp_path) == path


def test_loading_restores_parameters_and_optimizer_state_exactly(tmp_path) -> None:
    model, optimizer = trained(0)
    path = save(tmp_path, 3, model, optimizer)
    other, other_optimizer = trained(1)
    state, rank_state = load_training_checkpoint(path, other, other_optimizer)
    assert state["step"] == 3 and rank_state == {"loader": {"position": 7}}
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
    for param, other_param in zip(
        optimizer.param_groups[0]["params"], other_optimizer.param_groups[0]["params"]
    ):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[param][key], other_optimizer.state[other_param][key]), key
    # Both continue identically.
    for m, o in ((model, optimizer), (other, other_optimizer)):
        m(torch.ones(1, 4)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_compensated_adamw_state_comes_back_in_the_dtype_it_was_saved_in(tmp_path) -> None:
    """Its fp32 moments of a bf16 weight stay fp32 (Optimizer.load_state_dict, and so DCP's set_state_dict,
    would cast them to bf16), its bf16 compensation buffers stay bf16, all bit for bit."""
    from litsft.training.optimizer import COMPENSATION, CompensatedAdamW

    def bf16_trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Linear(4, 6).to(torch.bfloat16)
        optimizer = CompensatedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        model(torch.randn(5, 4, dtype=torch.bfloat16)).square().sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = bf16_trained(0)
    path = save(tmp_path, 1, model, optimizer)
    other, other_optimizer = bf16_trained(1)
    load_training_checkpoint(path, other, other_optimizer)
    for param, other_param in zip(model.parameters(), other.parameters()):
        saved, loaded = optimizer.state[param], other_optimizer.state[other_param]
        assert {k: v.dtype for k, v in loaded.items()} == {
            "step": torch.float32,
            "exp_avg": torch.float32,
            "exp_avg_sq": torch.float32,
            COMPENSATION: torch.bfloat16,
        }
        assert all(torch.equal(saved[key], loaded[key]) for key in saved)


def test_without_frozen_parameters_only_trained_ones_are_stored(tmp_path) -> None:
    model, optimizer = trained(0)
    path = save(tmp_path, 1, model, optimizer, save_frozen=False)
    other, other_optimizer = trained(1)
    frozen_before = other[2].weight.clone()
    load_training_checkpoint(path, other, other_optimizer, load_frozen=False)
    assert torch.equal(other[2].weight, frozen_before)
    assert torch.equal(other[0].weight, model[0].weight)


def test_a_crash_before_the_rename_leaves_only_a_partial_directory(tmp_path, monkeypatch) -> None:
    """Publication is one rename of a complete directory: a write that fails first publishes nothing, keeps
    the earlier checkpoint, and what it left is removed at the next start."""
    model, optimizer = trained(0)
    earlier = save(tmp_path, 1, model, optimizer)
    monkeypatch.setenv(FAULT_ENV, "save_2_before_rename:enospc")
    with pytest.raises(
        LitsftError, match=r"could not write checkpoint .*step-00000002 .*step-00000001 is intact"
    ):
        save(tmp_path, 2, model, optimizer)
    assert latest_checkpoint(tmp_path) == earlier
    assert not (tmp_path / "step-00000002").exists()
    monkeypatch.delenv(FAULT_ENV)
    (tmp_path / ".step-00000003.partial").mkdir()  # what a killed save leaves
    remove_partial_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_a_truncated_file_makes_a_checkpoint_incomplete(tmp_path) -> None:
    model, optimizer = trained(0)
    first, second = save(tmp_path, 1, model, optimizer), save(tmp_path, 2, model, optimizer)
    (shard,) = (second / "shards").glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:-10])
    assert not is_complete(second) and latest_checkpoint(tmp_path) == first
    with pytest.raises(LitsftError, match="not a complete litsft training checkpoint"):
        read_trainer_state(second)


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path) -> None:
    model, optimizer = trained(0)
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, optimizer)
    rotate_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    rotate_checkpoints(tmp_path, keep_last=None)  # keep everything
    assert len(list(tmp_path.iterdir())) == 2


class Payload:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_a_rank_file_holding_python_objects_is_refused_unread(tmp_path) -> None:
    path = tmp_path / "rank-00000.pt"
    path.write_bytes(pickle.dumps({"rng": Payload()}, protocol=2))
    with pytest.raises(LitsftError, match="refuses to unpickle"):
        load_rank_state(path)
    torch.save({"epoch": 2, "rng": torch.arange(3)}, path)
    assert load_rank_state(path)["epoch"] == 2
