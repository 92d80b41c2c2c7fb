import json
import os
import re

import pytest
import torch
from launch import litsft_in_process
from safetensors.torch import load_file, save_file
from tiny_hf import TINY_HF_MODELS, save_tiny_hf, tiny_hf_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import litsft.checkpoint.weight_files
from litsft.__main__ import main
from litsft.checkpoint.model_folder import load_model_state_dict, read_manifest
from litsft.checkpoint.weight_files import iter_tensors
from litsft.errors import LitsftError
from litsft.huggingface.convert import convert_from_hf, convert_to_hf
from litsft.model.config import Config
from litsft.model.families import FAMILIES
from litsft.model.families.spec import LLAMA_WEIGHTS
from litsft.model.network.transformer import Transformer

torch.set_num_threads(1)
TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_tensors(directory) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(directory))


@pytest.fixture
def llama_dir(tmp_path):
    return save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf")


def test_every_registered_family_has_a_tiny_transformers_model():
    """The round trip below runs every kind of tests/tiny_hf.py: together they cover every registered family."""
    covered = {model_class.__name__ for _, model_class in TINY_HF_MODELS.values()}
    assert covered == set(FAMILIES), f"add tiny transformers models for {sorted(set(FAMILIES) - covered)}"


@pytest.mark.parametrize("kind", list(TINY_HF_MODELS))
def test_roundtrip_matches_hugging_face(tmp_path, kind):
    hf_model = tiny_hf_model(kind)
    hf_dir = save_tiny_hf(hf_model, tmp_path / "hf")
    with torch.no_grad():
        hf_logits = hf_model(TOKENS).logits

    convert_from_hf(hf_dir, tmp_path / "litsft")
    model = Transformer(Config.from_checkpoint(tmp_path / "litsft")).eval()
    model.load_state_dict(load_model_state_dict(tmp_path / "litsft"))
    with torch.no_grad():
        logits = model(TOKENS)
    assert (logits - hf_logits).abs().max() < 1e-4

    convert_to_hf(tmp_path / "litsft", tmp_path / "export")
    original, exported = _hf_tensors(hf_dir), _hf_tensors(tmp_path / "export")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)

    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(TOKENS).logits, hf_logits)

    tokenizer, original_tokenizer = (
        AutoTokenizer.from_pretrained(tmp_path / "export"),
        AutoTokenizer.from_pretrained(hf_dir),
    )
    text = "Hello world, the quick dog reads 42 stories."
    assert tokenizer(text).input_ids == original_tokenizer(text).input_ids
    assert tokenizer.chat_template == original_tokenizer.chat_template is not None
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text()) == json.loads(
        (hf_dir / "generation_config.json").read_text()
    )


@pytest.mark.parametrize("layout", ["sharded-safetensors", "bin", "sharded-bin"])
def test_converts_every_weight_layout(tmp_path, layout):
    hf_model = tiny_hf_model("qwen2")
    kwargs = {
        "sharded-safetensors": {"max_shard_size": "40KB"},
        "bin": {"bin_shards": 1},
        "sharded-bin": {"bin_shards": 3},
    }
    hf_dir = save_tiny_hf(hf_model, tmp_path / "hf", **kwargs[layout])
    index = {
        "sharded-safetensors": "model.safetensors.index.json",
        "sharded-bin": "pytorch_model.bin.index.json",
    }
    if layout in index:
        assert len(set(json.loads((hf_dir / index[layout]).read_text())["weight_map"].values())) > 1
    else:
        assert (hf_dir / "pytorch_model.bin").is_file()

    convert_from_hf(hf_dir, tmp_path / "litsft")
    state_dict = load_model_state_dict(tmp_path / "litsft")
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(state_dict[LLAMA_WEIGHTS.litsft_names(name)[0]], tensor), name


def test_convert_streams_one_shard_at_a_time(tmp_path, llama_dir, monkeypatch):
    held = []
    add = litsft.checkpoint.weight_files.ShardedSafetensorsWriter.add

    def counting_add(writer, name, tensor):
        add(writer, name, tensor)
        held.append([t.nbytes for t in writer.shard.values()])

    monkeypatch.setattr(litsft.checkpoint.weight_files.ShardedSafetensorsWriter, "add", counting_add)
    convert_from_hf(llama_dir, tmp_path / "litsft", max_shard_size="40KB")
    assert len(held) == 21
    # Each shard is at most 40KB, except that a larger tensor (the 128KB embedding) is a shard of its own.
    assert all(sum(shard) <= 40_000 or len(shard) == 1 for shard in held)
    assert len(list((tmp_path / "litsft").glob("model-*-of-*.safetensors"))) >= 5


def test_dtype_casts_and_records_it(tmp_path, llama_dir):
    convert_from_hf(llama_dir, tmp_path / "litsft", dtype="bfloat16")
    assert Config.from_checkpoint(tmp_path / "litsft").torch_dtype == "bfloat16"
    assert {t.dtype for t in load_model_state_dict(tmp_path / "litsft").values()} == {torch.bfloat16}
    convert_to_hf(tmp_path / "litsft", tmp_path / "export", dtype="float32")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["torch_dtype"] == "float32"
    assert {t.dtype for t in _hf_tensors(tmp_path / "export").values()} == {torch.float32}


def test_tied_lm_head_stored_by_hf_is_dropped(tmp_path):
    hf_model = tiny_hf_model("llama-tied")
    hf_dir = save_tiny_hf(hf_model, tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    save_file(
        {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
        hf_dir / "model.safetensors",
    )
    convert_from_hf(hf_dir, tmp_path / "litsft")
    assert "lm_head.weight" not in load_file(tmp_path / "litsft" / "model.safetensors")


def _edit_config(hf_dir, **changes):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **changes}))


def _expect_error_and_nothing_written(tmp_path, hf_dir, message):
    out_dir = tmp_path / "out"
    with pytest.raises(LitsftError) as err:
        convert_from_hf(hf_dir, out_dir)
    assert str(err.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_unsupported_architecture(tmp_path, llama_dir):
    _edit_config(llama_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _expect_error_and_nothing_written(
        tmp_path,
        llama_dir,
        f"unsupported architecture 'GPT2LMHeadModel'; litsft supports {', '.join(FAMILIES)}",
    )


def test_missing_config(tmp_path, llama_dir):
    (llama_dir / "config.json").unlink()
    _expect_error_and_nothing_written(
        tmp_path,
        llama_dir,
        f"{llama_dir} has no config.json; point hf_dir at a Hugging Face checkpoint directory "
        "(the one with config.json and the weights)",
    )


def test_missing_shard(tmp_path):
    hf_dir = save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf", max_shard_size="40KB")
    shard = sorted(hf_dir.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    _expect_error_and_nothing_written(
        tmp_path,
        hf_dir,
        f"{shard.name} is listed in {hf_dir / 'model.safetensors.index.json'} but missing "
        f"from {hf_dir}; copy the complete checkpoint (all shards)",
    )


def test_shape_mismatch(tmp_path, llama_dir):
    _edit_config(llama_dir, intermediate_size=96)
    _expect_error_and_nothing_written(
        tmp_path,
        llama_dir,
        f"{llama_dir / 'model.safetensors'}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] "
        "but the config requires [96, 64]; the config does not match the weights, restore the original config",
    )


def test_missing_tensor(tmp_path, llama_dir):
    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, llama_dir / "model.safetensors")
    _expect_error_and_nothing_written(
        tmp_path,
        llama_dir,
        f"{llama_dir} lacks tensor 'model.layers.1.self_attn.k_proj.weight' that its config requires; "
        "the checkpoint is incomplete or its config belongs to another model",
    )


@pytest.mark.parametrize(
    ("kind", "dropped"),
    [
        ("qwen3-moe", ("gate_proj", "up_proj", "down_proj")),  # a whole expert of one layer
        ("mixtral", ("w3",)),  # one part of it
    ],
)
def test_a_weight_file_without_an_expert_names_what_it_lacks(tmp_path, kind, dropped):
    """Expert 3 of layer 1 lost from the weights (layer 0 keeps all 4): the missing tensors are named, not
    the config (it was "has shape [3, ...] but the config requires [4, ...]; restore the original config")."""
    hf_dir = save_tiny_hf(tiny_hf_model(kind), tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    prefix = (
        "model.layers.1.mlp.experts.3" if kind == "qwen3-moe" else "model.layers.1.block_sparse_moe.experts.3"
    )
    lost = [f"{prefix}.{part}.weight" for part in dropped]
    save_file({n: t for n, t in tensors.items() if n not in lost}, hf_dir / "model.safetensors")
    _expect_error_and_nothing_written(
        tmp_path,
        hf_dir,
        f"{hf_dir} lacks expert tensors {', '.join(sorted(lost))} (its fullest layer has 4 experts); the checkpoint is "
        "incomplete, download it again",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(num_experts_per_tok=0),
            "config.json's num_experts_per_tok is 0, but each token is routed to between 1 and num_experts=4 "
            "experts; restore the original config.json, or set it in that range",
        ),
        (
            dict(num_experts_per_tok=9),
            "config.json's num_experts_per_tok is 9, but each token is routed to between 1 and num_experts=4 "
            "experts; restore the original config.json, or set it in that range",
        ),
        (
            dict(num_experts_per_tok=None),
            "config.json lacks num_experts_per_tok, which a mixture of experts needs; restore the original "
            "config.json",
        ),
    ],
)
def test_a_config_json_routing_tokens_to_no_expert_or_too_many_names_the_value(tmp_path, change, message):
    """num_experts_per_tok 0 was called missing, and 9 of 4 experts was refused by litsft's own field name
    (experts_per_token) with no fix."""
    hf_dir = save_tiny_hf(tiny_hf_model("olmoe"), tmp_path / "hf")
    _edit_config(hf_dir, **change)
    _expect_error_and_nothing_written(tmp_path, hf_dir, message)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "model.layers.0.self_attn.q_proj.bias",
            "unexpected tensor 'model.layers.0.self_attn.q_proj.bias' that the config does not have; the config does not match the weights, restore the original config",
        ),
        (
            "model.layers.0.mlp.experts.weight",
            "tensor 'model.layers.0.mlp.experts.weight' has no counterpart in litsft's LlamaForCausalLM; litsft converts only checkpoints of the architectures it supports: "
            + ", ".join(FAMILIES),
        ),
    ],
)
def test_unexpected_tensor(tmp_path, llama_dir, extra, message):
    tensors = load_file(llama_dir / "model.safetensors")
    save_file({**tensors, extra: torch.zeros(64)}, llama_dir / "model.safetensors")
    _expect_error_and_nothing_written(tmp_path, llama_dir, f"{llama_dir / 'model.safetensors'}: {message}")


def test_malicious_bin_is_refused_and_not_run(tmp_path, llama_dir):
    from test_checkpoint_weight_files import _Malicious

    marker = tmp_path / "pwned"
    (llama_dir / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Malicious(marker)}, llama_dir / "pytorch_model.bin")
    _expect_error_and_nothing_written(
        tmp_path,
        llama_dir,
        f"{llama_dir / 'pytorch_model.bin'} holds Python objects other than tensors (posix.system) and litsft "
        "refuses to unpickle them; use a safetensors checkpoint or a plain state dict of tensors",
    )
    assert not marker.exists()


def test_existing_out_dir_is_refused_and_kept(tmp_path, llama_dir):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("keep me")
    with pytest.raises(LitsftError) as err:
        convert_from_hf(llama_dir, out_dir)
    assert str(err.value) == (
        f"output directory {out_dir} already exists and is not empty; choose another --out_dir or remove it"
    )
    assert [p.name for p in out_dir.iterdir()] == ["notes.txt"] and (
        out_dir / "notes.txt"
    ).read_text() == "keep me"


def test_failure_while_writing_leaves_nothing(tmp_path, llama_dir, monkeypatch):
    add = litsft.checkpoint.weight_files.ShardedSafetensorsWriter.add

    def failing_add(writer, name, tensor):
        if name.startswith("blocks.1."):
            raise OSError("disk full")
        add(writer, name, tensor)

    monkeypatch.setattr(litsft.checkpoint.weight_files.ShardedSafetensorsWriter, "add", failing_add)
    with pytest.raises(LitsftError) as err:
        convert_from_hf(llama_dir, tmp_path / "out", max_shard_size="40KB")
    assert str(err.value) == (
        f"cannot write the converted checkpoint to {tmp_path / 'out'} (disk full); pass an --out_dir on a "
        "writable disk with free space"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_default_out_dirs(tmp_path, llama_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    convert_from_hf(llama_dir)
    assert (tmp_path / "checkpoints" / "hf" / "litsft_config.json").is_file()
    convert_to_hf(tmp_path / "checkpoints" / "hf")
    assert (tmp_path / "checkpoints" / "hf-hf" / "config.json").is_file()


def test_cli(tmp_path, llama_dir, capsys, monkeypatch):
    """Both conversions and a refusal through the CLI, in this process (test_main.py runs the CLI as users do)."""
    monkeypatch.chdir(tmp_path)
    litsft_in_process(["convert_from_hf", str(llama_dir)], tmp_path, capsys)
    assert (tmp_path / "checkpoints" / "hf" / "litsft_config.json").is_file()

    litsft_in_process(["convert_to_hf", "checkpoints/hf"], tmp_path, capsys)
    assert (tmp_path / "checkpoints" / "hf-hf" / "config.json").is_file()  # the default out_dir

    bad = litsft_in_process(["convert_from_hf", str(tmp_path / "nowhere")], tmp_path, capsys, check=False)
    assert bad.returncode == 2
    assert bad.stderr == (
        f"error: {tmp_path / 'nowhere'} has no config.json; point hf_dir at a Hugging Face checkpoint "
        "directory (the one with config.json and the weights)\n"
    )


# ---- tokenizers -----------------------------------------------------------------------------------------
def hf_dir_with_vocab(directory, vocab_size: int):
    """A tiny Llama whose embedding table has `vocab_size` rows, saved with the 512-token tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_HF_MODELS["llama"][0].to_dict(), "vocab_size": vocab_size})
    return save_tiny_hf(LlamaForCausalLM(config).eval(), directory)


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    hf_dir = hf_dir_with_vocab(tmp_path / "hf", vocab_size=256)
    with pytest.raises(LitsftError) as err:
        convert_from_hf(hf_dir, tmp_path / "out")
    assert str(err.value) == (
        f"the tokenizer {hf_dir / 'tokenizer.json'} has 512 tokens but the model's vocab_size is 256: its ids "
        "past the embedding table would crash the model; convert the tokenizer that belongs to these weights"
    )
    assert not (tmp_path / "out").exists()


def test_damaged_tokenizer_json_is_one_line(tmp_path, llama_dir):
    (llama_dir / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(LitsftError) as err:
        convert_from_hf(llama_dir, tmp_path / "out")
    message = str(err.value)
    assert message.startswith(f"{llama_dir / 'tokenizer.json'} is not a valid tokenizer.json (")
    assert message.endswith("); copy it again from the original Hugging Face checkpoint")
    assert "\n" not in message
    assert not (tmp_path / "out").exists()


def test_folder_without_tokenizer_json_converts_with_a_note(tmp_path, capsys):
    hf_dir = save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf", tokenizer=False)
    capsys.readouterr()
    convert_from_hf(hf_dir, tmp_path / "out")
    assert capsys.readouterr().err == (
        f"note: {hf_dir} has no tokenizer.json, so neither has {tmp_path / 'out'}: training and generate need "
        f"one; copy it into {tmp_path / 'out'} (transformers' AutoTokenizer.save_pretrained writes it)\n"
    )
    assert (tmp_path / "out" / "litsft_config.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'out' / 'tokenizer.json'} is missing; copy tokenizer.json (and "
        "tokenizer_config.json) from the original Hugging Face checkpoint into the directory\n"
    )


SIDE_FILES = {
    "tokenizer.model": b"\x0a\x05sentencepiece",
    "vocab.json": b'{"a": 0}',
    "merges.txt": b"#version: 0.2\na b\n",
    "added_tokens.json": b'{"<x>": 600}',
    "chat_template.jinja": b"{{ messages[0]['content'] }}",
}


def test_tokenizer_side_files_survive_both_conversions(tmp_path, llama_dir):
    for name, content in SIDE_FILES.items():
        (llama_dir / name).write_bytes(content)
    convert_from_hf(llama_dir, tmp_path / "litsft")
    convert_to_hf(tmp_path / "litsft", tmp_path / "back")
    for directory in (tmp_path / "litsft", tmp_path / "back"):
        for name, content in SIDE_FILES.items():
            assert (directory / name).read_bytes() == content, (directory, name)
        assert (directory / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()


# ---- where the output goes ------------------------------------------------------------------------------
def test_output_in_an_unwritable_place_is_one_line(tmp_path, llama_dir):
    """A file where a directory should be: it fails for root too, unlike a read-only permission bit."""
    (tmp_path / "a-file").write_text("not a directory")
    out_dir = tmp_path / "a-file" / "out"
    with pytest.raises(LitsftError) as err:
        convert_from_hf(llama_dir, out_dir)
    assert re.fullmatch(
        rf"cannot write the converted checkpoint to {re.escape(str(out_dir))} \(Not a directory: "
        rf"{re.escape(str(tmp_path / 'a-file'))}/\.out\.tmp-[0-9a-f]{{8}}\); pass an --out_dir on a writable "
        "disk with free space",
        str(err.value),
    ), str(err.value)
    convert_from_hf(llama_dir, tmp_path / "litsft")
    with pytest.raises(LitsftError, match=r"^cannot write the Hugging Face checkpoint to .*a-file/out \("):
        convert_to_hf(tmp_path / "litsft", out_dir)
    assert (tmp_path / "a-file").read_text() == "not a directory"


def test_weight_files_are_readable_like_other_files(tmp_path, llama_dir):
    umask = os.umask(0o022)
    try:
        convert_from_hf(llama_dir, tmp_path / "litsft", max_shard_size="40KB")
        convert_to_hf(tmp_path / "litsft", tmp_path / "back")
    finally:
        os.umask(umask)
    files = [*(tmp_path / "litsft").iterdir(), *(tmp_path / "back").iterdir()]
    assert sum(p.suffix == ".safetensors" for p in files) > 2
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o644" for p in files}


def test_hub_cache_path_gives_the_hub_id(tmp_path):
    hf_dir = save_tiny_hf(
        tiny_hf_model("llama"), tmp_path / "models--someorg--tiny-llama" / "snapshots" / "abc123"
    )
    convert_from_hf(hf_dir, tmp_path / "from-cache")
    convert_from_hf(hf_dir, tmp_path / "named", hf_model_id="other/name")
    assert read_manifest(tmp_path / "from-cache")["hf_source"] == "someorg/tiny-llama"
    assert read_manifest(tmp_path / "named")["hf_source"] == "other/name"


def test_peft_format_of_a_full_checkpoint_is_an_error(tmp_path, llama_dir):
    convert_from_hf(llama_dir, tmp_path / "litsft")
    with pytest.raises(LitsftError) as err:
        convert_to_hf(tmp_path / "litsft", tmp_path / "peft", lora_format="peft")
    assert str(err.value) == (
        f"--lora_format peft: {tmp_path / 'litsft'} is a full model, not a LoRA checkpoint (it has no "
        "lora_config.json); drop --lora_format, or pass the final/ directory of a finetune_lora run"
    )
    assert not (tmp_path / "peft").exists()
