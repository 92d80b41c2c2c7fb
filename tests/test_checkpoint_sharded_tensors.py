"""litsft/checkpoint/sharded_tensors.py: tensors of any placement saved by some ranks and loaded by others
through DCP's safetensors storage (dim-1 shards, replicas written once), its refusals, and the rank helpers."""

from __future__ import annotations

import math
import pickle
import traceback
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from litsft.checkpoint.sharded_tensors import (
    ShardedReader,
    copy_local_part,
    first_failure,
    full_tensors,
    global_rank,
    plain,
    save_sharded,
    world_size,
)
from litsft.errors import LitsftError

FULL = torch.arange(48, dtype=torch.float32).reshape(4, 12)
STEP = torch.tensor(7.0)


def _placements(kind: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"dim0": [Shard(0)], "dim1": [Shard(1)], "replicated": [Replicate(), Shard(0)]}[kind]


def _distributed(kind: str, full: torch.Tensor) -> torch.Tensor:
    """`full` as this rank's DTensor in placement `kind` over every rank ("replicated": a (ranks, 1) mesh,
    as NO_SHARD and HYBRID_SHARD across nodes hold parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    shape = (world_size(), 1) if kind == "replicated" else (world_size(),)
    mesh = init_device_mesh("cpu", shape)
    target = distribute_tensor(torch.zeros_like(full), mesh, _placements(kind), src_data_rank=None)
    copy_local_part(target, full)
    return target


def _worker(rank: int, ranks: int, init_file: str, job: str, directory: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
        if job == "save":
            tensors = {kind: _distributed(kind, FULL) for kind in ("dim0", "dim1", "replicated")}
            tensors["step"] = STEP.clone()
            save_sharded(tensors, Path(directory))
            results.put((rank, "saved"))
        else:  # load every saved tensor into a dim-0 shard, whatever it was saved as
            targets = {
                kind: _distributed("dim0", torch.zeros_like(FULL)) for kind in ("dim0", "dim1", "replicated")
            }
            ShardedReader(Path(directory), fix="").load(targets)
            results.put((rank, {kind: t.full_tensor().tolist() for kind, t in targets.items()}))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _on_ranks(ranks: int, job: str, directory: Path, tmp_path: Path) -> dict:
    import torch.multiprocessing as mp

    # fork, not spawn: the children reuse this process's imports and start in a fraction of a second.
    context = mp.get_context("fork")
    results = context.Queue()
    init_file = tmp_path / f"init-{job}"
    workers = [
        context.Process(target=_worker, args=(rank, ranks, str(init_file), job, str(directory), results))
        for rank in range(ranks)
    ]
    for worker in workers:
        worker.start()
    answers = dict(results.get(timeout=180) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    for answer in answers.values():
        assert not isinstance(answer, str) or answer == "saved", answer
    return answers


def test_any_placement_saved_by_two_ranks_loads_exactly_into_one_and_into_another_placement(tmp_path) -> None:
    """A dim-1 shard (which litsft's former row format refused), dim-0 shards and replicas, saved by two
    ranks; read back whole by one process and as dim-0 shards by two. Replicas and the scalar every rank
    holds are written once."""
    directory = tmp_path / "shards"
    _on_ranks(2, "save", directory, tmp_path)

    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 2 and not list(directory.glob(".metadata"))
    written: dict[str, list[tuple[int, ...]]] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                written.setdefault(key, []).append(tuple(handle.get_slice(key).get_shape()))
    assert sorted(written["dim1"]) == [(4, 6), (4, 6)]  # each rank its columns
    assert written["replicated"] == [(4, 12)] and written["step"] == [()]  # once, not once per rank

    whole = {kind: torch.zeros_like(FULL) for kind in ("dim0", "dim1", "replicated")} | {
        "step": torch.zeros(())
    }
    ShardedReader(directory, fix="").load(whole)
    assert all(torch.equal(whole[kind], FULL) for kind in ("dim0", "dim1", "replicated"))
    assert torch.equal(whole["step"], STEP)

    for rank, loaded in _on_ranks(2, "load", directory, tmp_path).items():
        assert all(values == FULL.tolist() for values in loaded.values()), rank


class Bomb:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)


def test_loading_never_unpickles_dcps_metadata_file(tmp_path) -> None:
    """DCP's default reader unpickles `.metadata`; the safetensors reader reads headers only, so a pickle
    that would run code on load is never opened."""
    save_sharded({"w": FULL}, tmp_path)
    marker = tmp_path.parent / "exploded"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Bomb(marker)))
    target = {"w": torch.zeros_like(FULL)}
    ShardedReader(tmp_path, fix="").load(target)
    assert torch.equal(target["w"], FULL) and not marker.exists()


def test_a_damaged_file_a_wrong_shape_and_a_missing_tensor_are_one_line_each(tmp_path) -> None:
    save_sharded({"w": FULL}, tmp_path)
    with pytest.raises(LitsftError, match=r"holds shape \(4, 12\) but the model expects \(4, 6\)"):
        ShardedReader(tmp_path, fix="fix it").load({"w": torch.zeros(4, 6)})
    with pytest.raises(LitsftError, match="has no tensor 'v'; fix it"):
        ShardedReader(tmp_path, fix="fix it").load({"v": torch.zeros(4, 6)})
    (path,) = tmp_path.glob("*.safetensors")
    path.write_bytes(b"\xff" * 16 + path.read_bytes()[16:])
    with pytest.raises(LitsftError, match=r"\.safetensors is damaged \(.*\); fix it$"):
        ShardedReader(tmp_path, fix="fix it")


def test_one_process_copies_whole_tensors_and_names_its_failures() -> None:
    assert (global_rank(), world_size()) == (0, 1)
    target = torch.zeros_like(FULL)
    copy_local_part(target, FULL)
    assert torch.equal(target, FULL)
    assert first_failure(None) is None
    assert first_failure(OSError("disk full\nmore detail")) == (0, "disk full")


def test_full_tensors_casts_floating_point_only() -> None:
    named = {"w": FULL, "ids": torch.arange(3)}
    cast = dict(full_tensors(named, dtype=torch.bfloat16))
    assert cast["w"].dtype == torch.bfloat16 and cast["ids"].dtype == torch.int64
    assert torch.equal(cast["w"].float(), FULL)
    assert math.prod(cast["w"].shape) == FULL.numel()


def test_weights_wrapped_for_float8_all_gather_are_saved_and_loaded_as_plain_tensors(tmp_path: Path) -> None:
    """Tensorwise float8 with FSDP2 wraps each converted weight in torchao's WeightWithDynamicFloat8CastTensor,
    which safetensors cannot write: what is saved and gathered is the plain tensor inside, and what is loaded
    lands in it (they share storage)."""
    from torch import nn

    from litsft.model.float8 import convert_to_float8

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].up = nn.Linear(2048, 8192, bias=False)
    assert convert_to_float8(model, "tensorwise", fsdp_all_gather=True) == ["blocks.0.up"]
    weight = model.blocks[0].up.weight
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    saved = weight.detach().clone()
    save_sharded({"w": weight}, tmp_path / "shards")  # safetensors refuses the wrapper itself
    ((_, full),) = full_tensors({"w": weight}, dtype=torch.bfloat16)
    assert type(full) is torch.Tensor and full.dtype == torch.bfloat16
    with torch.no_grad():
        weight.zero_()
    ShardedReader(tmp_path / "shards", fix="save it again").load({"w": weight})
    assert torch.equal(plain(weight), plain(saved))
    new = torch.randn(8192, 2048)
    copy_local_part(weight, new)
    assert torch.equal(plain(weight), new)
