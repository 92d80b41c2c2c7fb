import pytest
import torch

from litsft.checkpoint.model_folder import (
    iter_model_tensors,
    load_model_state_dict,
    model_tensor_shapes,
    save_model_folder,
)
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network import Transformer


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
