"""litsft/checkpoint/sharded_tensors.py: tensors of any placement saved by some ranks and loaded by others
through DCP's safetensors storage (dim-1 shards, replicas written once), its refusals, and the rank helpers."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from launch import on_ranks
from safetensors import safe_open
from safetensors.torch import load_file

from litsft.checkpoint.sharded_tensors import (
    ShardedReader,
    copy_local_part,
    first_message,
    global_rank,
    local_bytes,
    pinned_stager,
    plain,
    save_consolidated,
    save_sharded,
    save_sharded_in_background,
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


def _save_every_placement(directory: Path) -> None:
    tensors = {kind: _distributed(kind, FULL) for kind in ("dim0", "dim1", "replicated")}
    save_sharded(tensors | {"step": STEP.clone()}, directory)


def _load_into_dim0_shards(directory: Path) -> dict[str, list]:
    """Every saved tensor loaded into a dim-0 shard, whatever it was saved as."""
    targets = {kind: _distributed("dim0", torch.zeros_like(FULL)) for kind in ("dim0", "dim1", "replicated")}
    ShardedReader(directory, fix="").load(targets)
    return {kind: t.full_tensor().tolist() for kind, t in targets.items()}


def test_any_placement_saved_by_two_ranks_loads_exactly_into_one_and_into_another_placement(tmp_path) -> None:
    """A dim-1 shard (which litsft's former row format refused), dim-0 shards and replicas, saved by two
    ranks; read back whole by one process and as dim-0 shards by two. Replicas and the scalar every rank
    holds are written once."""
    directory = tmp_path / "shards"
    on_ranks(2, _save_every_placement, tmp_path, directory)

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

    for rank, loaded in on_ranks(2, _load_into_dim0_shards, tmp_path, directory).items():
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


def test_one_process_copies_whole_tensors_and_names_its_message() -> None:
    assert (global_rank(), world_size()) == (0, 1)
    target = torch.zeros_like(FULL)
    copy_local_part(target, FULL)
    assert torch.equal(target, FULL)
    assert first_message("") is None
    assert first_message("disk full") == (0, "disk full")


def _lowest_rank_saying(rank_saying: int) -> tuple[tuple[int, str] | None, tuple[int, str] | None, int]:
    tensors = {kind: _distributed(kind, FULL) for kind in ("dim0", "dim1")} | {"step": STEP.clone()}
    said = first_message(f"rank {global_rank()} says no" if global_rank() >= rank_saying else "")
    return said, first_message(""), local_bytes(tensors)


def test_ranks_agree_on_the_lowest_rank_with_something_to_say_and_count_only_their_own_parts(
    tmp_path,
) -> None:
    answers = on_ranks(2, _lowest_rank_saying, tmp_path, 1)
    for said, silent, own_bytes in answers.values():
        assert said == (1, "rank 1 says no") and silent is None
        assert own_bytes == (24 + 24 + 1) * 4  # half of each 4x12 tensor, and the scalar every rank holds


def _save_three_times_in_background(directory: Path, make_stager) -> None:
    """Three background saves through one stager (which keeps its host buffers between them), the tensors
    changed after each save has staged them and before it is written: what is written is what was staged.
    The third save holds one tensor more (new buffers)."""
    import torch.distributed as dist

    group, stager = dist.new_group(backend="gloo"), make_stager()
    tensors = {kind: _distributed(kind, FULL) for kind in ("dim0", "dim1", "replicated")} | {
        "step": STEP.clone()
    }
    parts = [plain(t).to_local() if t.dim() else t for t in tensors.values()]
    for save in range(3):
        if save == 2:
            tensors["extra"] = _distributed("dim1", FULL + 200)
            parts.append(tensors["extra"].to_local())
        written = save_sharded_in_background(tensors, directory / f"save-{save}", group, stager=stager)
        for part in parts:
            part.add_(1000)  # the training step that runs while the files are written
        written.result()
        for part in parts:
            part.sub_(1000).add_(100)
    if stager is not None:
        stager.close()
        assert stager.state_dict_cache is None  # the buffers are dropped


def _kept_buffers_without_page_locking():
    """pinned_stager as it stages on a GPU, less the page-locking, which needs the driver."""
    torch.Tensor.pin_memory = lambda tensor: tensor  # in this forked rank only
    return pinned_stager()


@pytest.mark.parametrize(
    "make_stager", [lambda: None, _kept_buffers_without_page_locking], ids=["default", "kept_buffers"]
)
def test_a_background_save_writes_what_it_staged_also_into_kept_host_buffers(tmp_path, make_stager) -> None:
    on_ranks(2, _save_three_times_in_background, tmp_path, tmp_path, make_stager)
    for save in range(3):
        kinds = ("dim0", "dim1", "replicated", "extra")[: 4 if save == 2 else 3]
        whole = {kind: torch.zeros_like(FULL) for kind in kinds} | {"step": torch.zeros(())}
        ShardedReader(tmp_path / f"save-{save}", fix="").load(whole)
        assert all(torch.equal(whole[kind], FULL + 100 * save) for kind in kinds[:3]), save
        assert whole["step"].item() == STEP.item() + 100 * save
    assert torch.equal(whole["extra"], FULL + 200)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked staging copies from a CUDA device")
def test_on_a_gpu_background_saves_stage_into_page_locked_buffers_and_write_what_they_staged(
    tmp_path,
) -> None:
    tensors = {"weight": FULL.cuda(), "step": STEP.clone()}
    stager = pinned_stager()
    for save in range(2):
        written = save_sharded_in_background(tensors, tmp_path / f"save-{save}", None, stager=stager)
        tensors["weight"].add_(1000)
        written.result()
        tensors["weight"].sub_(1000).add_(100)
    assert stager.state_dict_cache["weight"].is_pinned()
    stager.close()
    for save in range(2):
        whole = {"weight": torch.zeros_like(FULL), "step": torch.zeros(())}
        ShardedReader(tmp_path / f"save-{save}", fix="").load(whole)
        assert torch.equal(whole["weight"], FULL + 100 * save) and whole["step"].item() == STEP.item()


def _save_whole(directory: Path) -> None:
    tensors = {kind: _distributed(kind, FULL) for kind in ("dim0", "dim1", "replicated")}
    save_consolidated(tensors, directory, {"dim0": 1, "dim1": 2, "replicated": 2})


def test_parts_of_any_placement_are_consolidated_into_whole_tensors_named_as_hugging_face_shards(
    tmp_path,
) -> None:
    on_ranks(2, _save_whole, tmp_path, tmp_path / "whole")
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    first, second = (load_file(tmp_path / "whole" / name) for name in files[:2])
    assert first.keys() == {"dim0"} and second.keys() == {"dim1", "replicated"}
    assert all(torch.equal(tensor, FULL) for tensor in (first["dim0"], second["dim1"], second["replicated"]))
    with pytest.raises(ValueError, match=r"0-dim tensors: \['step'\]"):  # consolidation would write zeros
        save_consolidated({"step": STEP}, tmp_path / "scalar", {"step": 1})
    index = json.loads((tmp_path / "whole" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["dim1"] == "model-00002-of-00002.safetensors"


def test_weights_wrapped_for_float8_all_gather_are_saved_and_loaded_as_plain_tensors(tmp_path: Path) -> None:
    """Tensorwise float8 with FSDP2 wraps each converted weight in torchao's WeightWithDynamicFloat8CastTensor,
    which safetensors cannot write: what is saved and gathered is the plain tensor inside, and what is loaded
    lands in it (they share storage)."""
    from torch import nn

    from litsft.model.precision.float8 import convert_to_float8

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].up = nn.Linear(2048, 8192, bias=False)
    assert convert_to_float8(model, "tensorwise", fsdp_all_gather=True) == ["blocks.0.up"]
    weight = model.blocks[0].up.weight
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    saved = weight.detach().clone()
    save_sharded({"w": weight}, tmp_path / "shards")  # safetensors refuses the wrapper itself
    save_consolidated({"w": weight}, tmp_path / "whole", {"w": 1})
    assert torch.equal(load_file(tmp_path / "whole" / "model-00001-of-00001.safetensors")["w"], plain(saved))
    with torch.no_grad():
        weight.zero_()
    ShardedReader(tmp_path / "shards", fix="save it again").load({"w": weight})
    assert torch.equal(plain(weight), plain(saved))
    new = torch.randn(8192, 2048)
    copy_local_part(weight, new)
    assert torch.equal(plain(weight), new)
