from pathlib import Path

import pytest
import torch
from launch import litsft_in_process
from tiny_tokenizer import write_tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from litsft.__main__ import main
from litsft.checkpoint.lora_folder import save_lora_folder
from litsft.checkpoint.model_folder import save_model_folder
from litsft.checkpoint.model_loader import load_model
from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError
from litsft.huggingface.convert import convert_from_hf, merge_lora
from litsft.inference.generate import (
    StopText,
    generate,
    generate_batch,
    generate_tokens,
    sample_next_token,
)
from litsft.model.config import Config
from litsft.model.lora.layers import LoRAConfig, apply_lora, lora_state_dict
from litsft.model.network.transformer import Transformer

HF_CONFIGS = {
    "llama": LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    ),
    "qwen3": Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.3,  # with the default 0.02, tied embeddings make greedy repeat one token
        bos_token_id=0,
        eos_token_id=1,
    ),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoints(request, tmp_path_factory) -> tuple[Path, Path]:
    """(Hugging Face dir, litsft dir) of a tiny random model with the tiny tokenizer."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(HF_CONFIGS[request.param])
    hf_model.save_pretrained(root / "hf")
    write_tiny_tokenizer(root / "hf", chat_template="llama3" if request.param == "llama" else "chatml")
    convert_from_hf(root / "hf", root / "litsft")
    return root / "hf", root / "litsft"


def _model(checkpoint_dir: Path, dtype: torch.dtype = torch.float32):
    return load_model(checkpoint_dir, torch.device("cpu"), dtype)


def _prompt(tokenizer: Tokenizer, text: str = "The quick cat reads a story") -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_matches_transformers(checkpoints, dtype):
    hf_dir, litsft_dir = checkpoints
    tokenizer = Tokenizer(litsft_dir)
    prompt = _prompt(tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    expected = hf_model.generate(
        prompt[None],
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=20,
        eos_token_id=tokenizer.stop_ids,
        pad_token_id=tokenizer.pad_id,
    )[0, len(prompt) :].tolist()
    if expected[-1] in tokenizer.stop_ids:  # transformers keeps the stop token, litsft leaves it out
        expected = expected[:-1]
    actual = generate_tokens(_model(litsft_dir, dtype), prompt, 20, stop_ids=tokenizer.stop_ids)
    assert actual.tolist() == expected
    assert len(expected) >= 10  # enough tokens to compare


def test_kv_cache_logits_match_full_recompute(checkpoints):
    _, litsft_dir = checkpoints
    model = _model(litsft_dir)
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)  # (B, T, V)
        model.setup_kv_caches(2, 16)
        position_ids = torch.arange(12).expand(2, -1)
        cached = [model(tokens[:, :5], position_ids=position_ids[:, :5])]  # prefill, then one token at a time
        cached += [model(tokens[:, t : t + 1], position_ids=position_ids[:, t : t + 1]) for t in range(5, 12)]
        model.clear_kv_caches()
    # float32 rounding grows with the logits (about 11 for the qwen3 model, whose weights are drawn wide) and
    # differs between CPUs' vector units: measured 9.4e-6 here, on a 2-core machine. A cache bug (a wrong
    # position or rotation) is off by O(1).
    atol = 4e-6 * expected.abs().max().item()
    torch.testing.assert_close(torch.cat(cached, dim=1), expected, atol=atol, rtol=0)


def test_top_k_1_is_greedy_and_sampling_is_seeded(checkpoints):
    _, litsft_dir = checkpoints
    model = _model(litsft_dir)
    prompt = _prompt(Tokenizer(litsft_dir))
    greedy = generate_tokens(model, prompt, 15)

    def sample(seed: int, **kwargs) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return generate_tokens(model, prompt, 15, temperature=1.0, generator=generator, **kwargs).tolist()

    assert sample(1, top_k=1) == greedy.tolist()
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(7, top_p=0.9, top_k=50) == sample(7, top_p=0.9, top_k=50)
    assert sample(7) != greedy.tolist()


def test_top_p_and_top_k_restrict_the_candidates():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(300, -1)
    generator = torch.Generator().manual_seed(0)

    def drawn(**kwargs) -> set[int]:
        return set(sample_next_token(logits, 1.0, generator=generator, **kwargs).tolist())

    assert drawn() == {0, 1, 2, 3}
    assert drawn(top_p=0.8) == {0, 1}  # 0.5 + 0.3 reaches 0.8: the nucleus is complete
    assert drawn(top_p=0.81) == {0, 1, 2}
    assert drawn(top_p=0.1) == {0}
    assert drawn(top_k=3) == {0, 1, 2}
    assert sample_next_token(logits, 0.0).unique().tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_batch_equals_one_by_one(checkpoints, dtype):
    _, litsft_dir = checkpoints
    model = _model(litsft_dir, dtype)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 512, (n,), generator=generator).tolist() for n in (3, 9, 1, 9, 6)]
    # Stop at a token the first prompt produces mid-way, so stopping is exercised.
    free_run = generate_tokens(model, torch.tensor(prompts[0]), 8).tolist()
    cut = next(i for i in range(2, 8) if free_run[i] not in free_run[:i])
    stop_ids = [1, free_run[cut]]
    expected = [generate_tokens(model, torch.tensor(p), 8, stop_ids=stop_ids).tolist() for p in prompts]
    assert expected[0] == free_run[:cut]
    assert generate_batch(model, prompts, 8, stop_ids) == expected
    assert generate_batch(model, prompts, 8, stop_ids, max_batch_size=2) == expected
    assert model.kv_caches is None


def test_stop_text_ends_a_row_once_its_newest_tokens_hold_a_stop_string(checkpoints):
    """Token ids stand for text here (each id's digits and a space): the row whose output contains the stop
    string ends at the step that completes it, the others run on; no token before the end changes."""
    _, litsft_dir = checkpoints
    model = _model(litsft_dir, torch.float32)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 512, (n,), generator=generator).tolist() for n in (4, 7, 2)]
    free = generate_batch(model, prompts, 10)
    row = next(i for i, output in enumerate(free) if len(set(output[:6])) >= 4)
    stop = f" {free[row][2]} {free[row][3]} "  # spans two tokens
    decode = lambda ids: " " + " ".join(map(str, ids)) + " "  # noqa: E731
    stopped = generate_batch(model, prompts, 10, stop_text=StopText([stop], decode, window=4))
    for i, (output, cut) in enumerate(zip(free, stopped)):
        end = next((n for n in range(1, len(output) + 1) if stop in decode(output[max(0, n - 4) : n])), None)
        assert cut == (output[:end] if end is not None else output), i
    assert len(stopped[row]) <= 4 < len(free[row])


def test_generation_errors(checkpoints):
    _, litsft_dir = checkpoints
    model = _model(litsft_dir)
    with pytest.raises(LitsftError, match=r"prompt \+ max_new_tokens = 138 tokens exceeds .* \(128\)"):
        generate_tokens(model, torch.arange(10), 128)
    assert model.kv_caches is None
    with pytest.raises(LitsftError, match="temperature=-1.0 is negative"):
        generate_tokens(model, torch.arange(10), 5, temperature=-1.0)
    with pytest.raises(LitsftError, match=r"top_p=0.0 must be in \(0, 1\]"):
        generate_tokens(model, torch.arange(10), 5, temperature=1.0, top_p=0.0)


def test_generate_prints_the_completion(checkpoints, capsys):
    _, litsft_dir = checkpoints
    tokenizer = Tokenizer(litsft_dir)
    text = tokenizer.render_chat([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    expected = generate_tokens(_model(litsft_dir), torch.tensor(tokenizer.encode(text, add_bos=False)), 6)
    generate(litsft_dir, prompt="hello", max_new_tokens=6)
    out, err = capsys.readouterr()
    assert out == tokenizer.decode(expected.tolist()) + "\n"
    assert err.startswith("[chat template applied; ")

    raw = generate_tokens(_model(litsft_dir), torch.tensor(tokenizer.encode("hello")), 6)
    generate(litsft_dir, prompt="hello", max_new_tokens=6, chat=False)
    assert capsys.readouterr().out == tokenizer.decode(raw.tolist()) + "\n"


def test_generate_without_template(tmp_path, checkpoints):
    _, litsft_dir = checkpoints
    for path in litsft_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    write_tiny_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(LitsftError, match="has no chat template; pass --chat false"):
        generate(tmp_path, max_new_tokens=2, chat=True)


def test_cli(tmp_path, capsys):
    config = Config.from_name("tiny-llama")
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    write_tiny_tokenizer(tmp_path)
    save_model_folder(model.state_dict().items(), config, tmp_path)
    command = ["generate", str(tmp_path), "--prompt", "hello", "--max_new_tokens", "5"]
    result = litsft_in_process(command, tmp_path, capsys)
    assert result.stderr.startswith("[chat template applied; ")
    again = litsft_in_process(command, tmp_path, capsys)
    assert result.stdout.strip() and again.stdout == result.stdout  # greedy: the same completion
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--temperature", "-2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: temperature=-2.0 is negative; use 0 for greedy decoding or a positive value\n"
    )


def test_generate_on_a_lora_folder_equals_the_merged_model(tmp_path, checkpoints, capsys):
    """`litsft generate <lora out_dir>/final`: the base with its adapters, token for token the merged model."""
    _, litsft_dir = checkpoints
    lora_config = LoRAConfig(rank=4, targets=["q", "v", "down", "lm_head"])
    adapted = apply_lora(_model(litsft_dir), lora_config)
    with torch.no_grad():  # adapters large enough to change what greedy decoding picks
        for name, param in adapted.named_parameters():
            if param.requires_grad:
                param.copy_(
                    0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
                )
    save_lora_folder(lora_state_dict(adapted), lora_config, litsft_dir, tmp_path / "final")
    merge_lora(tmp_path / "final", tmp_path / "merged")
    completions = []
    for directory in (litsft_dir, tmp_path / "final", tmp_path / "merged"):
        capsys.readouterr()
        main(["generate", str(directory), "--prompt", "hello", "--max_new_tokens", "12"])
        completions.append(capsys.readouterr().out)
    base_completion, lora_completion, merged_completion = completions
    assert lora_completion == merged_completion
    assert lora_completion != base_completion  # the adapters are in use
    tokens = torch.arange(20)[None]
    with torch.no_grad():
        torch.testing.assert_close(
            _model(tmp_path / "final")(tokens), _model(tmp_path / "merged")(tokens), atol=1e-4, rtol=0
        )


def test_tokenizer_larger_than_the_vocabulary_is_refused_at_load(tmp_path, capsys):
    config = Config.from_name("tiny-llama", vocab_size=256)
    write_tiny_tokenizer(tmp_path)  # 512 tokens
    save_model_folder(Transformer(config).state_dict().items(), config, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tmp_path), "--max_new_tokens", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: the tokenizer {tmp_path / 'tokenizer.json'} has 512 tokens but the model's vocab_size is 256: "
        "its ids past the embedding table would crash the model; put the tokenizer of these weights into the "
        "checkpoint directory\n"
    )


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA variant needs a GPU"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_generation_under_bf16_autocast(adapters, device):
    """Generation under bf16-mixed, as the validation sample runs it: fp32 weights under autocast (and with
    LoRA the frozen base stored in bf16, as the engine stores it). Under autocast RoPE leaves the keys in
    fp32 while the values come out of their projection in bf16 (index_copy_ into one cache dtype failed);
    the cache holds both in bf16, and the cached logits of the generated sequence equal a full recompute
    under the same autocast to bf16 rounding."""
    from litsft.training.engine import store_frozen_in_compute_dtype

    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    if adapters:
        model = apply_lora(model, LoRAConfig(rank=4, alpha=8, targets="all-linear"))
        store_frozen_in_compute_dtype(model, torch.bfloat16)
    model = model.to(device).eval()
    prompt = torch.randint(5, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(0))
    with torch.autocast(device, dtype=torch.bfloat16), torch.no_grad():
        generated = generate_tokens(model, prompt.to(device), 6)
        assert model.kv_caches is None and len(generated) == 6
        tokens = torch.cat([prompt.to(device), generated])[None]  # (1, 13)
        expected = model(tokens)
        model.setup_kv_caches(1, tokens.shape[1])
        positions = torch.arange(tokens.shape[1], device=device)[None]
        cached = [model(tokens[:, :7], position_ids=positions[:, :7])]
        cached += [model(tokens[:, t : t + 1], position_ids=positions[:, t : t + 1]) for t in range(7, 13)]
        assert model.kv_caches[0].k.dtype == model.kv_caches[0].v.dtype == torch.bfloat16
        model.clear_kv_caches()
    difference = (torch.cat(cached, dim=1).float() - expected.float()).abs().max()
    assert difference <= 0.02 * expected.float().abs().max(), difference
