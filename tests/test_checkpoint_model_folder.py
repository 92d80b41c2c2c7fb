from pathlib import Path

import pytest
import torch
from launch import on_ranks

from litsft.checkpoint.model_folder import (
    iter_model_tensors,
    load_model_state_dict,
    model_tensor_shapes,
    read_manifest,
    save_model_folder,
    save_model_folder_from_ranks,
)
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_roundtrip_loads_into_transformer(tmp_path, tied):
    config = Config.from_name("tiny-llama", tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "tokenizer.json").write_text("{}")
    save_model_folder(model.state_dict().items(), config, tmp_path / "ckpt", tmp_path / "source", "100KB")

    shapes = model_tensor_shapes(tmp_path / "ckpt")
    assert ("lm_head.weight" in shapes) is not tied
    assert shapes["embed.weight"] == ((512, 64), torch.float32)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == "{}"
    assert Config.from_checkpoint(tmp_path / "ckpt") == config
    assert len(list((tmp_path / "ckpt").glob("model-*-of-*.safetensors"))) > 1

    loaded = Transformer(config)
    loaded.load_state_dict(load_model_state_dict(tmp_path / "ckpt"))  # strict
    assert (loaded.lm_head.weight is loaded.embed.weight) is tied
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert dict(iter_model_tensors(tmp_path / "ckpt")).keys() == shapes.keys()


def _seeded_model(config: Config) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    return model


def _save_fully_sharded(config: Config, out_dir: Path, tokenizer_dir: Path, max_shard_size: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = _seeded_model(config), init_device_mesh("cpu", (2,))
    for unit in (*model.blocks, model):
        fully_shard(unit, mesh=mesh)
    save_model_folder_from_ranks(model, out_dir, config, tokenizer_dir, max_shard_size)


@pytest.mark.parametrize(("tied", "max_shard_size"), [(False, "100KB"), (True, "5GB")])
def test_a_model_sharded_on_two_ranks_is_written_as_one_process_writes_its_state_dict(
    tmp_path: Path, tied: bool, max_shard_size: str
) -> None:
    """The final folder of a sharded run (every rank writes its parts, rank 0 consolidates them) has the files,
    bf16 tensors and fingerprint that `save_model_folder` writes from the whole model in one process."""
    config = Config.from_name("tiny-llama", tie_word_embeddings=tied, torch_dtype="bfloat16")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    on_ranks(
        2, _save_fully_sharded, tmp_path, config, tmp_path / "ranks", tmp_path / "tokenizer", max_shard_size
    )

    whole = {name: tensor.to(torch.bfloat16) for name, tensor in _seeded_model(config).state_dict().items()}
    save_model_folder(whole.items(), config, tmp_path / "one", tmp_path / "tokenizer", max_shard_size)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == files
    assert ("model.safetensors" in files) is (max_shard_size == "5GB")
    assert read_manifest(tmp_path / "ranks") == read_manifest(tmp_path / "one")
    written = load_model_state_dict(tmp_path / "ranks")
    assert written.keys() == whole.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in whole.items())


def test_save_model_folder_replaces_earlier_shards(tmp_path):
    config = Config.from_name("tiny-llama")
    model = Transformer(config)
    save_model_folder(model.state_dict().items(), config, tmp_path, max_shard_size="100KB")
    (tmp_path / "model-00007.safetensors.partial").write_text("left by a crashed save")
    save_model_folder(model.state_dict().items(), config, tmp_path, max_shard_size="5GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "litsft_config.json",
        "litsft_manifest.json",
        "model.safetensors",
    ]


def test_not_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(LitsftError, match=r"is not a litsft checkpoint: litsft_config.json is missing"):
        load_model_state_dict(tmp_path)
