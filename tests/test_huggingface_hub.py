"""`litsft download` and hub ids, against a local stand-in for the Hugging Face Hub (tests/hub_server.py) that the
real huggingface_hub client talks to through HF_ENDPOINT: nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
import torch
from hub_server import LocalHub
from launch import free_port, litsft, write_records
from test_training_engine import finetune_args
from tiny_hf import save_tiny_hf, tiny_hf_model
from transformers import LlamaConfig, LlamaForCausalLM

from litsft.checkpoint.model_loader import load_model

TOKENS = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
MIB = 2**20
# huggingface_hub reads the body in chunks of 10 MiB and resumes from the last whole chunk it wrote.
DOWNLOAD_CHUNK = 10 * MIB


def hub_env(hub: LocalHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_OFFLINE="0",
        HF_TOKEN="",
    )
    return {**env, **extra}


def run(args: list[str], hub: LocalHub, tmp_path: Path, check: bool = True, **env: str):
    return litsft(args, tmp_path, check=check, cwd=tmp_path, env=hub_env(hub, tmp_path, **env))


def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def litsft_logits(checkpoint_dir: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_model(checkpoint_dir, torch.device("cpu"), torch.float32)(TOKENS)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Tiny HF models saved as hub repositories: main and v2 revisions, a .bin-only one and one large enough
    (17 MB) to be read in more than one 10 MiB chunk."""
    root = tmp_path_factory.mktemp("hub-models")
    models = {}
    for name, seed in (("main", 0), ("v2", 1)):
        models[name] = (tiny_hf_model("llama", seed=seed), root / name)
        save_tiny_hf(models[name][0], root / name)
    (root / "main" / "README.md").write_text("not fetched\n")
    (root / "main" / "flax_model.msgpack").write_bytes(b"not fetched")
    models["bin"] = (models["main"][0], save_tiny_hf(models["main"][0], root / "bin", bin_shards=1))
    torch.manual_seed(0)
    big = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    ).eval()
    models["big"] = (big, save_tiny_hf(big, root / "big"))
    assert (root / "big" / "model.safetensors").stat().st_size > DOWNLOAD_CHUNK + 2 * MIB
    return models


def test_download_fetches_what_litsft_reads_converts_it_and_never_downloads_twice(models, tmp_path) -> None:
    with LocalHub() as hub:
        hub.add_repo("org/tiny", models["main"][1])
        hub.add_repo("org/tiny", models["v2"][1], revision="v2")
        result = run(["download", "org/tiny"], hub, tmp_path)
        checkpoint = tmp_path / "checkpoints" / "org" / "tiny"
        assert "saved the litsft checkpoint to checkpoints/org/tiny" in result.stderr
        fetched = sorted(
            r.path.rsplit("/", 1)[1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path
        )
        assert fetched == sorted(
            ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json"]
            + ["tokenizer.json", "tokenizer_config.json"]
        )
        torch.testing.assert_close(litsft_logits(checkpoint), hf_logits(models["main"][0]), atol=1e-5, rtol=0)
        source = json.loads((checkpoint / "hub_source.json").read_text())
        assert source == {
            "repo_id": "org/tiny",
            "revision": "main",
            "commit": hub.repos["org/tiny"].find("main").sha,
        }
        assert json.loads((checkpoint / "litsft_config.json").read_text())["name"] == "org/tiny"

        # Already there: not a single request to the hub.
        requests = len(hub.requests)
        again = run(["download", "org/tiny"], hub, tmp_path)
        assert "already holds org/tiny; nothing to download" in again.stderr
        assert len(hub.requests) == requests

        # Another revision: into its own directory, with its own weights.
        error = one_error_line(run(["download", "org/tiny", "--revision", "v2"], hub, tmp_path, check=False))
        assert "already holds org/tiny at revision main" in error and "--out_dir" in error
        run(
            ["download", "org/tiny", "--revision", "v2", "--out_dir", "checkpoints/org/tiny-v2"],
            hub,
            tmp_path,
        )
        v2 = tmp_path / "checkpoints" / "org" / "tiny-v2"
        torch.testing.assert_close(litsft_logits(v2), hf_logits(models["v2"][0]), atol=1e-5, rtol=0)
        missing = one_error_line(
            run(["download", "org/tiny", "--revision", "v9", "--out_dir", "x"], hub, tmp_path, check=False)
        )
        assert missing == "error: org/tiny has no revision 'v9'; pass an existing branch, tag or commit"


def test_a_dropped_connection_resumes_with_a_range_request(models, tmp_path) -> None:
    big, source = models["big"]
    with LocalHub() as hub:
        hub.add_repo("org/big", source)
        hub.drop_once["model.safetensors"] = DOWNLOAD_CHUNK + MIB  # the connection dies 11 MiB in
        run(["download", "org/big"], hub, tmp_path)
        gets = hub.gets("model.safetensors")
        assert [g.range for g in gets] == [None, f"bytes={DOWNLOAD_CHUNK}-"]  # the second asks for the rest
    torch.testing.assert_close(
        litsft_logits(tmp_path / "checkpoints" / "org" / "big"), hf_logits(big), atol=1e-5, rtol=0
    )


def test_a_download_killed_half_way_keeps_its_finished_files(models, tmp_path) -> None:
    big, source = models["big"]
    with LocalHub() as hub:
        hub.add_repo("org/big", source)
        hub.stall["model.safetensors"] = DOWNLOAD_CHUNK + MIB  # sends 11 MiB, then hangs
        env = {**launch.test_env(tmp_path), **hub_env(hub, tmp_path), "MASTER_PORT": str(free_port())}
        process = subprocess.Popen(
            [sys.executable, "-m", "litsft", "download", "org/big"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cached = tmp_path / "hf-home" / "hub" / "models--org--big" / "snapshots"
        small_files = ["config.json", "tokenizer.json", "tokenizer_config.json"]
        deadline = time.monotonic() + launch.DEADLINE_S
        while not (hub.gets("model.safetensors") and all(list(cached.glob(f"*/{f}")) for f in small_files)):
            assert time.monotonic() < deadline and process.poll() is None, "the download did not get going"
            time.sleep(0.2)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert not (tmp_path / "checkpoints" / "org" / "big").exists()

        del hub.stall["model.safetensors"]
        run(["download", "org/big"], hub, tmp_path)
        for name in small_files:
            assert len(hub.gets(name)) == 1, name  # kept from the killed run, not fetched again
        assert len(hub.gets("model.safetensors")) == 2
    torch.testing.assert_close(
        litsft_logits(tmp_path / "checkpoints" / "org" / "big"), hf_logits(big), atol=1e-5, rtol=0
    )


def test_unknown_and_gated_repositories_are_one_line_errors(models, tmp_path) -> None:
    with LocalHub() as hub:
        hub.add_repo("org/gated", models["main"][1], token="hf_secret")
        error = one_error_line(run(["download", "org/missing"], hub, tmp_path, check=False))
        assert error.startswith(
            f"error: org/missing is not a local directory and {hub.url} has no model repository org/missing"
        )
        error = one_error_line(run(["download", "org/gated"], hub, tmp_path, check=False))
        assert "org/gated is a gated model" in error and "set HF_TOKEN" in error
        assert not (tmp_path / "checkpoints").exists()
        # The token from HF_TOKEN is the one sent, and it opens the repository.
        run(["download", "org/gated"], hub, tmp_path, HF_TOKEN="hf_secret")
        assert hub.gets("model.safetensors")[-1].authorization == "Bearer hf_secret"
        run(["download", "org/gated", "--out_dir", "gated-2", "--access_token", "hf_secret"], hub, tmp_path)
    for directory in (tmp_path / "checkpoints" / "org" / "gated", tmp_path / "gated-2"):
        torch.testing.assert_close(litsft_logits(directory), hf_logits(models["main"][0]), atol=1e-5, rtol=0)


class RunsCode:
    """Unpickling this runs a shell command, which is what a hostile .bin file does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_pickle_weights_are_refused_unless_asked_for_and_never_unpickled(models, tmp_path) -> None:
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for file in models["bin"][1].iterdir():
        (hostile / file.name).write_bytes(file.read_bytes())
    marker = tmp_path / "code-ran"
    torch.save({"model.embed_tokens.weight": RunsCode(f"touch {marker}")}, hostile / "pytorch_model.bin")
    with LocalHub() as hub:
        hub.add_repo("org/bin", models["bin"][1])
        hub.add_repo("org/hostile", hostile)
        error = one_error_line(run(["download", "org/bin"], hub, tmp_path, check=False))
        assert "org/bin has only pickle weights (pytorch_model.bin)" in error
        assert "pass --allow_pickle_weights true" in error
        assert not hub.gets("pytorch_model.bin")  # refused before anything was fetched

        run(["download", "org/bin", "--allow_pickle_weights", "true"], hub, tmp_path)
        torch.testing.assert_close(
            litsft_logits(tmp_path / "checkpoints" / "org" / "bin"),
            hf_logits(models["bin"][0]),
            atol=1e-5,
            rtol=0,
        )
        error = one_error_line(
            run(["download", "org/hostile", "--allow_pickle_weights", "true"], hub, tmp_path, check=False)
        )
        assert "refuses to unpickle" in error and "posix.system" in error
    assert not marker.exists()
    assert not (tmp_path / "checkpoints" / "org" / "hostile").exists()


def test_offline_uses_what_is_converted_and_says_what_is_missing(models, tmp_path) -> None:
    with LocalHub() as hub:
        hub.add_repo("org/tiny", models["main"][1])
        run(["download", "org/tiny"], hub, tmp_path)
        requests = len(hub.requests)
        generate = ["generate", "org/tiny", "--prompt", "hello", "--max_new_tokens", "3", "--chat", "false"]
        result = run(generate, hub, tmp_path, HF_HUB_OFFLINE="1")
        assert "3 tokens in" in result.stderr  # generated from the converted checkpoint
        error = one_error_line(run(["generate", "org/other"], hub, tmp_path, check=False, HF_HUB_OFFLINE="1"))
        assert "HF_HUB_OFFLINE is set and org/other was never downloaded here" in error
        # Downloaded but not converted (the conversion was interrupted): converted from the local files.
        (tmp_path / "checkpoints" / "org" / "tiny").rename(tmp_path / "elsewhere")
        run(["download", "org/tiny"], hub, tmp_path, HF_HUB_OFFLINE="1")
        assert len(hub.requests) == requests  # offline means offline
    torch.testing.assert_close(
        litsft_logits(tmp_path / "checkpoints" / "org" / "tiny"),
        hf_logits(models["main"][0]),
        atol=1e-5,
        rtol=0,
    )


def test_finetune_lora_on_a_hub_id_exports_an_adapter_peft_loads(models, tmp_path) -> None:
    """The path a new user takes: a hub id straight into finetune_lora, then a PEFT adapter for the original
    transformers model, which gives the same logits as litsft's model with the adapter."""
    import peft

    from litsft.checkpoint.lora_folder import read_lora_folder
    from litsft.model.lora.layers import iter_merged_tensors

    write_records(tmp_path / "data.json", count=48)
    with LocalHub() as hub:
        hub.add_repo("org/tiny", models["main"][1])
        args = finetune_args(Path("org/tiny"), tmp_path / "data.json", tmp_path / "out", 4, 3)
        args = ["finetune_lora", *args[1:], "--lora.rank", "4", "--lora.alpha", "8", "--lora.dropout", "0"]
        result = run(args, hub, tmp_path)
        assert "Model: hub id org/tiny, downloaded and converted into checkpoints/org/tiny" in result.stdout
    final = tmp_path / "out" / "final"
    run(["convert_to_hf", str(final), "--out_dir", "peft", "--lora_format", "peft"], hub, tmp_path)
    assert (
        json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "org/tiny"
    )

    folder = read_lora_folder(final)
    assert folder.base_dir == (tmp_path / "checkpoints" / "org" / "tiny").resolve()
    model = load_model(folder.base_dir, torch.device("cpu"), torch.float32)
    base = model.state_dict()
    model.load_state_dict(dict(iter_merged_tensors(base.items(), folder.adapters, folder.config)))
    original = tiny_hf_model("llama", seed=0)
    peft_model = peft.PeftModel.from_pretrained(original, tmp_path / "peft").eval()
    with torch.no_grad():
        peft_logits = peft_model(TOKENS).logits
        with peft_model.disable_adapter():
            assert (peft_model(TOKENS).logits - peft_logits).abs().max() > 1e-4  # the adapter does something
        torch.testing.assert_close(peft_logits, model(TOKENS), atol=1e-5, rtol=0)
