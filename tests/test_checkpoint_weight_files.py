import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from litsft.checkpoint.weight_files import (
    ShardedSafetensorsWriter,
    iter_tensors,
    load_safetensors,
    parse_size,
    shard_numbers,
    tensor_infos,
    write_safetensors,
)
from litsft.errors import LitsftError


def _tensors(count: int = 6, numel: int = 250) -> dict[str, torch.Tensor]:
    """`count` fp32 tensors of 1000 bytes each, with distinct values."""
    return {f"t{i}": torch.arange(numel, dtype=torch.float32) + i for i in range(count)}


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1234, 1234),
        ("1234", 1234),
        ("5GB", 5 * 10**9),
        ("500MB", 5 * 10**8),
        ("2GiB", 2 * 2**30),
        ("1.5kb", 1500),
    ],
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(
        LitsftError, match=r"^max_shard_size='5 gigs' is not a size; write it like 5GB, 500MB"
    ):
        parse_size("5 gigs")


def test_writer_single_file_has_no_index(tmp_path):
    tensors = _tensors()
    files = write_safetensors(tensors.items(), tmp_path, "1MB")
    assert files == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_writer_shards_like_hugging_face(tmp_path):
    tensors = _tensors()
    # 2500 bytes per shard: two 1000-byte tensors fit, a third does not -> 3 shards of 2.
    write_safetensors(tensors.items(), tmp_path, 2500)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 6000}
    # The rule the final folder's consolidation is given up front: the same shard for every tensor.
    numbers = shard_numbers(((name, tensor.nbytes) for name, tensor in tensors.items()), 2500)
    assert numbers == {name: int(file.split("-")[1]) for name, file in index["weight_map"].items()}
    assert index["weight_map"] == {f"t{i}": f"model-0000{i // 2 + 1}-of-00003.safetensors" for i in range(6)}
    assert dict(iter_tensors(tmp_path)).keys() == tensors.keys()
    assert all(torch.equal(t, tensors[n]) for n, t in iter_tensors(tmp_path))


def test_shard_numbers_follow_the_writer_after_an_empty_tensor(tmp_path):
    """An empty tensor opens a shard as any other does: a larger-than-max tensor after it starts the next."""
    tensors = {"empty": torch.zeros(0), "big": torch.zeros(750), "small": torch.zeros(250)}  # 0, 3000, 1000 B
    write_safetensors(tensors.items(), tmp_path, 2500)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    numbers = shard_numbers(((name, tensor.nbytes) for name, tensor in tensors.items()), 2500)
    assert numbers == {name: int(file.split("-")[1]) for name, file in weight_map.items()}
    assert numbers == {"empty": 1, "big": 2, "small": 3}


def test_writer_holds_at_most_one_shard(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path, 2500)
    held, files_on_disk = [], []
    for name, tensor in _tensors(count=7).items():
        writer.add(name, tensor)
        held.append(sum(t.nbytes for t in writer.shard.values()))
        files_on_disk.append(len(list(tmp_path.iterdir())))
    writer.close()
    assert max(held) <= 2500
    # Full shards go to disk as soon as the next tensor does not fit, not at close().
    assert files_on_disk == [0, 0, 1, 1, 2, 2, 3]


def test_writer_puts_an_oversized_tensor_in_its_own_shard(tmp_path):
    tensors = {"small": torch.zeros(10), "big": torch.zeros(1000), "small2": torch.zeros(10)}
    write_safetensors(tensors.items(), tmp_path, 100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "small": "model-00001-of-00003.safetensors",
        "big": "model-00002-of-00003.safetensors",
        "small2": "model-00003-of-00003.safetensors",
    }


def test_writer_copies_views_of_larger_tensors(tmp_path):
    base = torch.arange(12.0)
    write_safetensors([("a", base[:6]), ("b", base[6:])], tmp_path)
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["a"], base[:6]) and torch.equal(loaded["b"], base[6:])


def test_tensor_infos_reads_headers_of_every_layout(tmp_path):
    tensors = {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.float16)}
    expected = {"a": ((3, 4), torch.bfloat16), "b": ((5,), torch.float16)}
    (tmp_path / "st").mkdir()
    write_safetensors(tensors.items(), tmp_path / "st", 20)  # two shards with an index
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    assert tensor_infos(tmp_path / "st") == expected
    assert tensor_infos(tmp_path / "bin") == expected
    assert all(torch.equal(t, tensors[n]) for n, t in iter_tensors(tmp_path / "bin"))


def test_no_weights_is_an_error(tmp_path):
    with pytest.raises(LitsftError) as err:
        tensor_infos(tmp_path)
    assert str(err.value) == (
        f"no weights in {tmp_path}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


@pytest.mark.parametrize(
    ("keep", "reason"), [(-8, "incomplete metadata, file not fully covered"), (4, "header too small")]
)
def test_truncated_safetensors_is_an_error(tmp_path, keep, reason):
    save_file(_tensors(2), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:keep])
    with pytest.raises(LitsftError) as err:
        dict(iter_tensors(tmp_path))
    assert str(err.value) == (
        f"{tmp_path / 'model.safetensors'} is not a valid safetensors file (Error while deserializing header: "
        f"{reason}); it may be truncated, download it again"
    )


def test_load_safetensors_reads_every_tensor_or_names_the_fix(tmp_path):
    path = tmp_path / "a.safetensors"
    written = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(written, path)
    loaded = load_safetensors(path, fix="do this")
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(
        LitsftError, match=r"^.*a\.safetensors is not a valid safetensors file \(.*\); do this$"
    ):
        load_safetensors(path, fix="do this")


def test_missing_shard_is_an_error(tmp_path):
    write_safetensors(_tensors().items(), tmp_path, 2500)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(LitsftError) as err:
        tensor_infos(tmp_path)
    assert str(err.value) == (
        f"model-00002-of-00003.safetensors is listed in {tmp_path / 'model.safetensors.index.json'} but missing "
        f"from {tmp_path}; copy the complete checkpoint (all shards)"
    )


@pytest.mark.parametrize("content", [[torch.zeros(2)], {"a": torch.zeros(2), "step": 3}])
def test_bin_that_is_not_a_state_dict_is_an_error(tmp_path, content):
    torch.save(content, tmp_path / "pytorch_model.bin")
    with pytest.raises(LitsftError) as err:
        tensor_infos(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'pytorch_model.bin'} is not a plain state dict (a dict of tensor names to tensors); "
        "save the model's state_dict() or use safetensors"
    )


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_bin_is_an_error(tmp_path, damage):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"a": torch.zeros(100)}, path)
    path.write_bytes(path.read_bytes()[:300] if damage == "truncated" else b"garbage" * 20)
    with pytest.raises(LitsftError) as err:
        tensor_infos(tmp_path)
    assert str(err.value) == f"{path} is not a readable PyTorch weights file; download it again"


class _Malicious:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "pytorch_model.bin"
    torch.save({"model.embed_tokens.weight": _Malicious(marker)}, path)
    with pytest.raises(LitsftError) as err:
        tensor_infos(tmp_path)
    assert str(err.value) == (
        f"{path} holds Python objects other than tensors (posix.system) and litsft refuses to unpickle them; "
        "use a safetensors checkpoint or a plain state dict of tensors"
    )
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the file really is malicious: a plain unpickle runs the command
    assert marker.exists()
