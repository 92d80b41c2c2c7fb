"""litsft/checkpoint/training_checkpoint.py: what a step checkpoint holds on disk (read back by checkpoint_dirs.py,
whose own tests on plain directories are in tests/test_checkpoint_checkpoint_dirs.py), its atomic publication,
loading it back, rotation, leftovers, and refusing pickled objects."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
from pathlib import Path

import pytest
import torch
from launch import DEADLINE_S, on_ranks
from torch import nn

from litsft.checkpoint.checkpoint_dirs import (
    TRAINER_STATE,
    checkpoint_name,
    find_damage,
    is_complete,
    latest_checkpoint,
    read_trainer_state,
)
from litsft.checkpoint.training_checkpoint import (
    RANK_STATE_KEY,
    checkpoint_tensors,
    load_legacy_rank_state,
    load_rank_state,
    load_training_checkpoint,
    remove_partial_checkpoints,
    rng_state,
    rotate_checkpoints,
    save_training_checkpoint,
    set_rng_state,
    start_background_save,
)
from litsft.errors import LitsftError
from litsft.runtime import files
from litsft.runtime.faults import FAULT_ENV
from litsft.runtime.files import checksum_of_file, readable_size


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


def test_a_checkpoint_holds_its_files_listed_with_their_sizes_and_checksums(tmp_path) -> None:
    model, optimizer = trained(0)
    path = save(tmp_path, 12, model, optimizer)
    assert path == tmp_path / "step-00000012" == tmp_path / checkpoint_name(12)
    state = json.loads((path / TRAINER_STATE).read_text())
    assert state["files"] == ["rank-00000.safetensors", "shards/shard-00001-model-00001-of-00001.safetensors"]
    assert state["format"] == "dcp-safetensors"
    assert state["file_sizes"] == {name: (path / name).stat().st_size for name in state["files"]}
    # Hashed as written, equal to hashing the files on disk.
    assert state["file_checksums"] == {name: checksum_of_file(path / name) for name in state["files"]}
    assert all(value.startswith("xxh3_128:") for value in state["file_checksums"].values())
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


def test_a_background_save_holds_the_state_of_its_step_and_is_published_only_once_written(
    tmp_path, monkeypatch
) -> None:
    """Training goes on while the files are written: the checkpoint holds the state at the save, not the
    state of the steps taken meanwhile, and until every file is on disk the previous checkpoint is the
    newest complete one (a kill then loses nothing: tests/test_fault_injection.py kills a run there)."""
    import threading

    from litsft.checkpoint import training_checkpoint

    model, optimizer = trained(0)
    earlier = save(tmp_path, 1, model, optimizer)
    at_save = [p.detach().clone() for p in model.parameters()]
    writing, may_write = threading.Event(), threading.Event()

    def gate(name: str, rank: int = 0) -> None:
        if name == "save_2_writing_in_background":
            writing.set()
            assert may_write.wait(timeout=DEADLINE_S)

    monkeypatch.setattr(training_checkpoint, "fault_point", gate)
    background = start_background_save(
        tmp_path, 2, model, optimizer, {"recipe": "t"}, {"loader": {}}, True, None, keep_last=None
    )
    assert writing.wait(timeout=DEADLINE_S)
    assert latest_checkpoint(tmp_path) == earlier and (tmp_path / ".step-00000002.partial").is_dir()
    model(torch.ones(1, 4)).sum().backward()  # the next step, while the files are being written
    optimizer.step()
    may_write.set()
    assert background.wait() == tmp_path / "step-00000002" == latest_checkpoint(tmp_path)
    state = read_trainer_state(tmp_path / "step-00000002")  # checksums handed on by the writing thread
    assert sorted(state["file_checksums"]) == state["files"]
    assert find_damage(tmp_path / "step-00000002", contents=True) is None

    other, other_optimizer = trained(1)
    load_training_checkpoint(tmp_path / "step-00000002", other, other_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(at_save, other.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(at_save, model.parameters()))


def test_a_full_disk_names_the_file_the_space_a_checkpoint_takes_and_the_intact_one(
    tmp_path, monkeypatch
) -> None:
    """The kernel's ENOSPC names no file: the line says which file was being written, where, what a step
    checkpoint of the run takes there and what was free, and that the previous checkpoint is intact."""
    model, optimizer = trained(0)
    save(tmp_path, 1, model, optimizer)
    real_open = open

    class FullDisk:
        def __init__(self, file) -> None:
            self.file = file

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name: str):
            return getattr(self.file, name)

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return FullDisk(file) if "w" in mode and Path(path).name.startswith("shard-") else file

    monkeypatch.setattr(files, "open", open_on_a_full_disk, raising=False)
    with pytest.raises(LitsftError) as refused:
        save(tmp_path, 2, model, optimizer)
    tensor_bytes = sum(t.numel() * t.element_size() for t in checkpoint_tensors(model, optimizer).values())
    shard = tmp_path / ".step-00000002.partial" / "shards" / "shard-00001-model-00001-of-00001.safetensors"
    message = str(refused.value)
    assert message.startswith(
        f"could not write checkpoint {tmp_path / 'step-00000002'} (rank 0: [Errno 28] No space left on device: "
        f"'{shard}'; a step checkpoint of this run takes {readable_size(tensor_bytes)} on the disk of "
        f"{tmp_path}, where "
    ), message
    assert message.endswith(
        " was free); step-00000001 is intact: free disk space or fix permissions, then relaunch the same "
        "command to resume"
    ), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_a_background_save_that_fails_raises_at_the_wait_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
) -> None:
    model, optimizer = trained(0)
    save(tmp_path, 1, model, optimizer)
    monkeypatch.setenv(FAULT_ENV, "save_2_writing_in_background:enospc")
    background = start_background_save(
        tmp_path, 2, model, optimizer, {"recipe": "t"}, {"loader": {}}, True, None, keep_last=1
    )
    with pytest.raises(
        LitsftError,
        match=r"could not write checkpoint \S+step-00000002 \(rank 0: \[Errno 28\] No space left on device: "
        r"'\(fault injected at save_2_writing_in_background\)'; a step checkpoint of this run takes 592 B on "
        r"the disk of \S+, where .* was free\); step-00000001 is intact",
    ):
        background.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


class Payload:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_a_rank_file_is_safetensors_with_json_and_its_state_comes_back_exactly(tmp_path) -> None:
    """Nothing in it is a pickle: the tensors (torch's RNG state) are safetensors, the rest JSON in the header,
    tuples kept tuples (Python's random.setstate takes nothing else); the restored streams go on as the saved."""
    model, optimizer = trained(0)
    random.seed(5)
    torch.manual_seed(5)
    rank_state = {"rng": rng_state(), "loader": {"position": 7, "seed": 3}, "loss_scaler": {"scale": 0.5}}
    path = save_training_checkpoint(tmp_path, 1, model, optimizer, {"recipe": "t"}, rank_state)
    expected = (random.random(), torch.rand(3))
    from safetensors import safe_open

    with safe_open(path / "rank-00000.safetensors", framework="pt") as handle:
        assert list(handle.keys()) == ["rng.torch"]
        assert json.loads(handle.metadata()[RANK_STATE_KEY])["loader"] == {"position": 7, "seed": 3}
    loaded = load_rank_state(path, 0)
    assert {k: v for k, v in loaded.items() if k != "rng"} == {
        "loader": {"position": 7, "seed": 3},
        "loss_scaler": {"scale": 0.5},
    }
    assert loaded["rng"]["python"] == rank_state["rng"]["python"]
    set_rng_state(loaded["rng"])
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_a_legacy_rank_file_holding_python_objects_is_refused_unread(tmp_path) -> None:
    """A checkpoint written before rank files were safetensors has rank-XXXXX.pt: read with torch's
    weights-only unpickler, plain data only."""
    path = tmp_path / "rank-00000.pt"
    path.write_bytes(pickle.dumps({"rng": Payload()}, protocol=2))
    with pytest.raises(LitsftError, match="refuses to unpickle"):
        load_rank_state(tmp_path, 0)
    torch.save({"epoch": 2, "rng": torch.arange(3)}, path)
    assert load_rank_state(tmp_path, 0)["epoch"] == 2


def test_a_legacy_rank_file_overwritten_with_other_bytes_is_called_damaged_not_python_objects(
    tmp_path,
) -> None:
    """Bytes that are no pickle at all (a disk fault, a bad copy) at the size the file was written with,
    so the size check before resuming passes them: the line says the file is damaged and how to go on."""
    path = tmp_path / "step-00000004" / "rank-00000.pt"
    path.parent.mkdir()
    torch.save({"epoch": 2, "rng": torch.arange(3)}, path)
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256) + b"\xfc" * (path.stat().st_size % 256))
    with pytest.raises(LitsftError) as refused:
        load_legacy_rank_state(path)
    message = str(refused.value)
    assert message.startswith(f"{path} is damaged (") and "Python objects" not in message
    assert message.endswith(f"move {path.parent} aside (rename it) to resume from the checkpoint before it, "
                            "or pass --resume <an older step dir>")  # fmt: skip


# ---- every layout, and elastic resume, on several processes of a CPU mesh ------------------------------------
STAGES = [
    # (sharding, mesh shape): each stage resumes the previous one's checkpoint, takes one step and saves.
    ("one process", (1,)),
    ("FULL_SHARD", (2,)),
    ("HYBRID_SHARD", (2, 2)),  # 2 nodes x 2 devices: shards in a node, replicas across nodes
    ("DIM_1", (4,)),  # every matrix sharded along dim 1 (as torchtitan shards experts), which rows could not
    ("NO_SHARD", (2, 1)),
    ("SHARD_GRAD_OP", (2,)),
    ("one process", (1,)),
]


def _stage(sharding: str, shape: tuple[int, ...], work: Path, index: int) -> list[str]:
    """Build the tiny model in this stage's layout, resume the previous stage's checkpoint and compare every
    parameter and optimizer state with what it saved (bit for bit), then train one step and save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from litsft.model.config import Config
    from litsft.model.network.transformer import Transformer
    from litsft.training.args import FSDPConfig, OptimizerConfig
    from litsft.training.optimizer import build_optimizer
    from litsft.training.parallel import parallelize

    rank = torch.distributed.get_rank()
    torch.manual_seed(index)  # a different start each stage: only the resume makes them agree
    model = Transformer(Config.from_name("tiny-llama"))
    model.init_weights(index + 1)
    if sharding == "DIM_1":
        mesh = init_device_mesh("cpu", shape)
        for unit in (*model.blocks, model):
            fully_shard(unit, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
        assert model.blocks[0].mlp.gate_proj.weight.placements == (Shard(1),)
    elif sharding != "one process":
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        parallelize(model, mesh, FSDPConfig(sharding_strategy=sharding), "32-true")
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))

    def full_state() -> dict[str, torch.Tensor]:
        def whole(t: torch.Tensor) -> torch.Tensor:
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

        state = {f"model/{n}": whole(p) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            state |= {f"optimizer/{n}/{k}": whole(v) for k, v in optimizer.state.get(p, {}).items()}
        return state

    differences = []
    if index > 0:
        load_training_checkpoint(work / f"stage-{index - 1}" / "step-00000001", model, optimizer)
        expected = torch.load(work / f"expected-{index - 1}.pt", weights_only=True)
        loaded = full_state()
        differences = [k for k in expected if k not in loaded or not torch.equal(expected[k], loaded[k])]
        differences += sorted(set(loaded) - set(expected))
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(100 * rank + index))
    model(input_ids=tokens, labels=tokens).backward()
    optimizer.step()
    optimizer.zero_grad()
    save_training_checkpoint(work / f"stage-{index}", 1, model, optimizer, {"recipe": "t"}, {"rank": rank})
    state = full_state()  # collective under FSDP: every rank gathers
    if rank == 0:
        torch.save(state, work / f"expected-{index}.pt")
    return differences


TUTORIAL = Path(__file__).resolve().parent.parent / "tutorials" / "resume.md"
TUTORIAL_CHECKPOINT = 'CHECKPOINT = "out/inspect/step-00000002"'


def opened_as_the_tutorial_says(checkpoint: Path, block_with: str, result: str) -> dict[str, torch.Tensor]:
    """Run the tutorial's python block that holds `block_with` on `checkpoint`, as written but for the
    checkpoint's path, and return the variable `result` it leaves."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S) if block_with in b]
    assert TUTORIAL_CHECKPOINT in block
    namespace: dict = {}
    exec(block.replace(TUTORIAL_CHECKPOINT, f"CHECKPOINT = {str(checkpoint)!r}"), namespace)
    return namespace[result]


def test_every_layout_resumes_every_other_bit_for_bit_and_writes_replicas_once(tmp_path) -> None:
    """One process -> 2 (FULL_SHARD) -> 4 (HYBRID_SHARD, 2 nodes) -> 4 (dim-1 shards) -> 2 (NO_SHARD) -> 2
    (SHARD_GRAD_OP) -> one process: each resumes the checkpoint the one before saved and finds every
    parameter and AdamW state exactly as it was saved. Each checkpoint's files hold every tensor once: the
    replicas of HYBRID_SHARD and NO_SHARD, and the scalars every rank holds, are written by one rank only."""
    import math

    from safetensors import safe_open

    for index, (sharding, shape) in enumerate(STAGES):
        answers = on_ranks(math.prod(shape), _stage, tmp_path, sharding, shape, tmp_path, index)
        for rank, differences in answers.items():
            assert differences == [], (sharding, rank, differences)

        expected = torch.load(tmp_path / f"expected-{index}.pt", weights_only=True)
        stored_elements: dict[str, int] = {}
        checkpoint = tmp_path / f"stage-{index}" / "step-00000001"
        # Every rank's files are listed with the checksum of their bytes, gathered by rank 0.
        state = read_trainer_state(checkpoint)
        assert sorted(state["file_checksums"]) == state["files"], sharding
        assert find_damage(checkpoint, contents=True) is None, sharding
        # Opened without litsft, as the resume tutorial shows: with torch's reader, and with safetensors alone.
        for block_with, result in (("HuggingFaceStorageReader(", "state"), ("DCP_SHARDING_INFO", "tensors")):
            opened = opened_as_the_tutorial_says(checkpoint, block_with, result)
            assert opened.keys() == expected.keys(), (sharding, block_with)
            assert all(torch.equal(opened[k], expected[k]) for k in expected), (sharding, block_with)
        for path in (checkpoint / "shards").glob("*.safetensors"):
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    shape_on_disk = handle.get_slice(key).get_shape()
                    stored_elements[key] = stored_elements.get(key, 0) + math.prod(shape_on_disk)
        assert stored_elements == {key: tensor.numel() for key, tensor in expected.items()}, sharding
