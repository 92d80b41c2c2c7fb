"""litsft/checkpoint/sharded_rows.py: rows of a tensor stored as row blocks across files, read across block
boundaries and into a target, and the single-process answers of the rank helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from litsft.checkpoint.sharded_rows import (
    RowReader,
    copy_rows,
    first_failure,
    full_tensors,
    global_rank,
    local_rows,
    world_size,
)
from litsft.errors import LitsftError

FULL = torch.arange(40, dtype=torch.float32).reshape(10, 4)


@pytest.fixture
def reader(tmp_path: Path) -> RowReader:
    """FULL written the way two ranks write a checkpoint: rows 0-5 in one file, rows 6-9 in another."""
    save_file({"model/w": FULL[:6].clone(), "model/step": torch.tensor(3.0)}, tmp_path / "rank-0.safetensors")
    save_file({"model/w": FULL[6:].clone()}, tmp_path / "rank-1.safetensors")
    return RowReader(
        {
            "w": [
                (tmp_path / "rank-1.safetensors", "model/w", 6, 4),
                (tmp_path / "rank-0.safetensors", "model/w", 0, 6),
            ],
            "step": [(tmp_path / "rank-0.safetensors", "model/step", 0, 1)],
        }
    )


def test_rows_are_read_across_blocks_in_any_order(reader: RowReader) -> None:
    assert reader.names() == {"w", "step"}
    assert torch.equal(reader.read("w", 0, 10), FULL)
    assert torch.equal(reader.read("w", 4, 8), FULL[4:8])  # spans both files
    assert torch.equal(reader.read("w", 7, 9), FULL[7:9])
    assert reader.read("step", 0, 1).item() == 3.0  # a scalar is one row


def test_fill_copies_the_rows_a_process_holds(reader: RowReader) -> None:
    target = torch.zeros(10, 4)
    reader.fill("w", target)
    assert torch.equal(target, FULL)
    with pytest.raises(
        LitsftError, match=r"checkpoint rows have shape \(10, 4\) but the model expects \(10, 3\)"
    ):
        reader.fill("w", torch.zeros(10, 3))


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_a_file_stays_mapped_only_while_a_tensor_read_from_it_lives(reader: RowReader) -> None:
    """Pages read through a mapping count in the process's resident memory until it is unmapped: the reader
    keeps no file open between reads, so loading a model never holds the whole checkpoint resident."""

    def mapped() -> set[str]:
        maps = Path("/proc/self/maps").read_text()
        return {name for name in ("rank-0.safetensors", "rank-1.safetensors") if name in maps}

    rows = reader.read("w", 0, 4)
    assert torch.equal(rows, FULL[:4]) and mapped() == {"rank-0.safetensors"}  # a view of the mapping
    reader.fill("w", torch.zeros(10, 4))
    assert mapped() == {"rank-0.safetensors"}  # fill keeps no view: only the file `rows` views
    del rows
    assert mapped() == set()


def test_rows_no_file_holds_are_reported(tmp_path: Path) -> None:
    save_file({"w": FULL[:6].clone()}, tmp_path / "only.safetensors")
    partial = RowReader({"w": [(tmp_path / "only.safetensors", "w", 0, 6)]})
    with pytest.raises(LitsftError, match="rows 6:10 of 'w' are in no checkpoint file"):
        partial.read("w", 6, 10)


def test_one_process_holds_every_row_and_writes_them() -> None:
    assert (global_rank(), world_size()) == (0, 1)
    local, offset, is_writer = local_rows(FULL)
    assert local is FULL and (offset, is_writer) == (0, True)
    target = torch.zeros(10, 4)
    copy_rows(target, FULL)
    assert torch.equal(target, FULL)


def test_first_failure_names_the_failing_rank_and_its_first_line() -> None:
    assert first_failure(None) is None
    assert first_failure(OSError("disk full\nmore detail")) == (0, "disk full")


def test_full_tensors_casts_floating_point_only() -> None:
    named = {"w": FULL, "ids": torch.arange(3)}
    cast = dict(full_tensors(named, dtype=torch.bfloat16))
    assert cast["w"].dtype == torch.bfloat16 and cast["ids"].dtype == torch.int64
    assert torch.equal(cast["w"].float(), FULL)


def test_weights_wrapped_for_float8_all_gather_are_saved_and_loaded_as_plain_tensors(tmp_path: Path) -> None:
    """Tensorwise float8 with FSDP2 wraps each converted weight in torchao's WeightWithDynamicFloat8CastTensor,
    which safetensors cannot write: the rows saved and gathered are the plain tensor inside, and rows loaded
    land in it."""
    from torch import nn

    from litsft.model.float8 import convert_to_float8

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].up = nn.Linear(2048, 8192, bias=False)
    assert convert_to_float8(model, "tensorwise", fsdp_all_gather=True) == ["blocks.0.up"]
    weight = model.blocks[0].up.weight
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    local, offset, is_writer = local_rows(weight)
    assert type(local) in (torch.Tensor, nn.Parameter) and (offset, is_writer) == (0, True)
    save_file({"w": local.contiguous()}, tmp_path / "rows.safetensors")  # fails on the wrapper itself
    ((name, full),) = full_tensors({"w": weight}, dtype=torch.bfloat16)
    assert type(full) is torch.Tensor and full.dtype == torch.bfloat16
    new = torch.randn(8192, 2048)
    copy_rows(weight, new)
    assert torch.equal(local_rows(weight)[0], new)
