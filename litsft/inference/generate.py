"""Text generation with the KV cache: sampling for one prompt, batched greedy decoding for evaluation,
and the `litsft generate` command."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from litsft.checkpoint.lora_folder import is_lora_folder
from litsft.checkpoint.model_cache import open_step_checkpoint
from litsft.checkpoint.model_loader import load_model
from litsft.data.tokenizer import Tokenizer, check_tokenizer_fits
from litsft.errors import LitsftError
from litsft.huggingface.model_source import resolve_checkpoint
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer, long_rope_length


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` (B, V) -> (B,). Temperature 0 is greedy (argmax); otherwise
    sample from softmax(logits / temperature), restricted to the `top_k` most likely tokens and then to
    the smallest set whose probability reaches `top_p` (nucleus sampling)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        outside = mass_before >= top_p  # the nucleus was complete before this token
        outside[:, 0] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_tokens(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_token: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Continue one prompt, decoding with the model's KV cache.

    Args:
        model: A litsft `Transformer` (or a wrapper that forwards its methods). It is put in eval mode
            while generating and restored afterwards.
        prompt_ids: The prompt's token ids (T,).
        max_new_tokens: Generate at most this many tokens.
        temperature: 0 for greedy decoding; higher samples more freely.
        top_k: Sample only among the k most likely tokens.
        top_p: Sample only among the most likely tokens whose probabilities sum to top_p.
        stop_ids: Generation ends when one of these is produced; it is not part of the result.
        generator: Random generator for sampling, on the model's device, for reproducible samples.
        on_token: Called with each new token as it is generated (streaming); the stop token is not passed.

    Returns:
        The new tokens (N,), N <= max_new_tokens, on the model's device.
    """
    check_sampling(temperature, top_k, top_p)
    device = _device_of(model)
    prompt_ids = prompt_ids.reshape(1, -1).to(device)  # (1, T)
    prompt_length = prompt_ids.shape[1]
    if prompt_length == 0:
        raise LitsftError("the prompt is empty; generation needs at least one token to continue")
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    new_tokens: list[torch.Tensor] = []
    refeed_at = _refeed_position(model)
    with _kv_cached(model, 1, prompt_length + max_new_tokens):
        input_ids = prompt_ids
        position_ids = torch.arange(prompt_length, device=device)[None]  # (1, T)
        for _ in range(max_new_tokens):
            logits = model(input_ids, position_ids=position_ids)[:, -1]  # (1, V)
            token = sample_next_token(logits, temperature, top_k, top_p, generator)  # (1,)
            if torch.isin(token, stop).item():
                break
            new_tokens.append(token)
            if on_token is not None:
                on_token(int(token.item()))  # the stop check above has waited for the token already
            input_ids = token[:, None]  # (1, 1): the cache holds everything before it
            position_ids = position_ids[:, -1:] + 1
            if prompt_length + len(new_tokens) - 1 == refeed_at:  # cached keys rotated for a shorter sequence
                input_ids = torch.cat((prompt_ids[0], *new_tokens))[None]
                position_ids = torch.arange(input_ids.shape[1], device=device)[None]
    return torch.cat(new_tokens) if new_tokens else prompt_ids.new_empty(0)


def _refeed_position(model: nn.Module) -> int | None:
    """The position whose token makes the sequence long enough that RoPE changes for all of it (LongRoPE's
    switch to its long factors): there the whole sequence is fed again and the cache rewritten, as transformers'
    Phi-3 generation does. None: the cache stays valid."""
    config: Config | None = getattr(model, "config", None)
    return long_rope_length(config) if config is not None else None


@dataclass(frozen=True)
class StopText:
    """Text that ends a row once it appears in what the row generated: an evaluation task's stop strings.

    Args:
        strings: A row ends when its newest `window` tokens decode to text holding one of these.
        decode: Token ids to text.
        window: How many of a row's newest tokens are decoded at each step: enough to hold any of `strings`.
    """

    strings: Sequence[str]
    decode: Callable[[list[int]], str]
    window: int

    def reached(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(string in text for string in self.strings)


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    max_batch_size: int = 32,
    stop_text: StopText | None = None,
) -> list[list[int]]:
    """Greedy continuations of many prompts, batched, with the same tokens as `generate_tokens` one by one.

    No padding: every row holds its own tokens at the same cache slots. After a common prefill of the
    shortest prompt's length, each step feeds every row one token: the next prompt token while the row
    is still inside its prompt, else its last generated token. Rows therefore never attend to padding,
    at the cost of feeding the longer prompts' tails one token per step; prompts are sorted by length
    into batches so those tails stay short.

    Under FSDP every rank must call this with the same prompts: forward passes must happen in lockstep.

    Args:
        model: A litsft `Transformer`; put in eval mode while generating and restored afterwards.
        prompts: Token ids of each prompt.
        max_new_tokens: Generate at most this many tokens per prompt.
        stop_ids: A row ends when it produces one of these; it is not part of the result.
        max_batch_size: Decode at most this many prompts at once.
        stop_text: A row also ends once its text holds one of these strings; what it generated up to then is
            returned (the caller cuts the text at the string). Ending early changes no token before it.

    Returns:
        The new tokens of each prompt, in the order of `prompts`.
    """
    if any(len(prompt) == 0 for prompt in prompts):
        raise LitsftError("a prompt is empty; generation needs at least one token to continue")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), max_batch_size):
        indices = order[start : start + max_batch_size]
        outputs = _greedy_batch(
            model, [list(prompts[i]) for i in indices], max_new_tokens, stop_ids, stop_text
        )
        for i, output in zip(indices, outputs):
            results[i] = output
    return results


def _greedy_batch(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    stop_text: StopText | None = None,
) -> list[list[int]]:
    device = _device_of(model)
    batch_size = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    shortest, longest = min(len(p) for p in prompts), max(len(p) for p in prompts)
    total = longest + max_new_tokens
    tokens = torch.zeros(batch_size, total, dtype=torch.long, device=device)  # (B, S): prompt, then output
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(batch_size, dtype=torch.bool, device=device)
    starts = [len(prompt) for prompt in prompts]
    ends = [start + max_new_tokens for start in starts]  # where each row's output ends, at the latest
    refeed_at = _refeed_position(model)
    if max_new_tokens > 0:
        with _kv_cached(model, batch_size, total):
            position_ids = torch.arange(shortest, device=device).expand(batch_size, -1)  # (B, T)
            logits = model(tokens[:, :shortest], position_ids=position_ids)[:, -1]  # (B, V)
            for slot in range(shortest, total):
                in_prompt = slot < lengths
                predicted = sample_next_token(logits)  # (B,)
                tokens[:, slot] = torch.where(in_prompt, tokens[:, slot], predicted)
                done |= ~in_prompt & torch.isin(predicted, stop)
                done |= slot + 1 >= lengths + max_new_tokens
                if stop_text is not None:
                    _end_at_stop_text(tokens, done, slot, starts, ends, stop_text)
                if done.all().item():
                    break
                first = 0 if slot == refeed_at else slot  # see _refeed_position
                position_ids = torch.arange(first, slot + 1, device=device).expand(batch_size, -1)
                logits = model(tokens[:, first : slot + 1], position_ids=position_ids)[:, -1]
    outputs = []
    stop_set = set(stop_ids)
    for row, prompt in enumerate(prompts):
        output = []
        for token in tokens[row, len(prompt) : ends[row]].tolist():
            if token in stop_set:
                break
            output.append(token)
        outputs.append(output)
    return outputs


def _end_at_stop_text(
    tokens: torch.Tensor,
    done: torch.Tensor,
    slot: int,
    starts: list[int],
    ends: list[int],
    stop_text: StopText,
) -> None:
    """End the rows whose generated tokens (from `starts`, their prompts' lengths), up to `slot`, hold a stop
    string among their newest: done, and their output ends after `slot` (`ends`)."""
    first = max(0, slot + 1 - stop_text.window)
    recent = tokens[:, first : slot + 1].tolist()  # one copy to the host for every row
    for row, finished in enumerate(done.tolist()):
        if finished or slot < starts[row]:
            continue
        if stop_text.reached(recent[row][max(starts[row] - first, 0) :]):
            done[row] = True
            ends[row] = slot + 1


@contextmanager
def _kv_cached(model: nn.Module, batch_size: int, max_length: int) -> Iterator[None]:
    """Eval mode with KV caches of `max_length` slots; both undone on exit, even on error."""
    config: Config | None = getattr(model, "config", None)
    if config is not None and max_length > config.max_position_embeddings:
        raise LitsftError(
            f"prompt + max_new_tokens = {max_length} tokens exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings}); shorten the prompt or lower max_new_tokens"
        )
    was_training = model.training
    model.eval()  # also keeps activation checkpointing, which bypasses the cache, out of the way
    model.setup_kv_caches(batch_size, max_length)
    try:
        yield
    finally:
        model.clear_kv_caches()
        model.train(was_training)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_sampling(temperature: float, top_k: int | None, top_p: float) -> None:
    if temperature < 0:
        raise LitsftError(
            f"temperature={temperature} is negative; use 0 for greedy decoding or a positive value"
        )
    if top_k is not None and top_k < 1:
        raise LitsftError(f"top_k={top_k} must be at least 1; leave it unset to sample from all tokens")
    if not 0.0 < top_p <= 1.0:
        raise LitsftError(f"top_p={top_p} must be in (0, 1]; use 1.0 to sample from all tokens")


Dtype = Literal["float32", "bfloat16", "float16"]


def model_directory(checkpoint_dir: str) -> Path:
    """The local litsft model folder of anything a command names: a step checkpoint's model (written once
    into the cache), an HF folder or hub id converted (downloaded first) into the cache, a LoRA folder as is."""
    checkpoint_dir = open_step_checkpoint(checkpoint_dir, quiet=True)
    if not is_lora_folder(Path(checkpoint_dir)):  # a LoRA folder is read as is, with its base
        checkpoint_dir = resolve_checkpoint(checkpoint_dir, quiet=True)
    return Path(checkpoint_dir)


def open_model(
    checkpoint_dir: str, dtype: Dtype | None = None, device: torch.device | None = None
) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of anything a command names (a checkpoint, a LoRA final/ with its base, a
    step checkpoint, an HF folder, a hub id), on `device` (default: the GPU when there is one), in `dtype`
    (default bfloat16 on a GPU that supports it, else float32), in eval mode. Prints nothing on stdout."""
    checkpoint_dir = model_directory(checkpoint_dir)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        torch_dtype = torch.bfloat16 if use_bf16 else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    tokenizer = Tokenizer(checkpoint_dir)
    model = load_model(checkpoint_dir, device, torch_dtype)
    check_tokenizer_fits(
        tokenizer.vocab_size,
        model.config.vocab_size,
        checkpoint_dir / "tokenizer.json",
        fix="put the tokenizer of these weights into the checkpoint directory",
    )
    return model, tokenizer


def generate(
    checkpoint_dir: str,  # not Path, which would drop the ./ that marks a local directory
    prompt: str = "What food do llamas eat?",
    max_new_tokens: int = 50,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 1234,
    chat: bool | None = None,
    dtype: Dtype | None = None,
) -> None:
    """Generate a completion of a prompt with a litsft checkpoint and print it.

    Args:
        checkpoint_dir: The model: a litsft checkpoint directory (e.g. a training run's out_dir/final), a
            Hugging Face model directory (converted once, then cached) or a hub id such as
            meta-llama/Llama-3.2-1B (downloaded and converted into checkpoints/<org>/<name> on first use).
            The final/ of a finetune_lora run gives its base model with the adapters applied.
        prompt: The text to continue, or the user message in chat mode.
        max_new_tokens: Generate at most this many tokens; generation also stops at an end-of-turn token.
        temperature: 0 for greedy decoding (deterministic); e.g. 0.7 to sample.
        top_k: When sampling, pick only among the k most likely tokens.
        top_p: When sampling, pick only among the most likely tokens whose probabilities sum to top_p.
        seed: Random seed for sampling.
        chat: Send the prompt as a user message through the checkpoint's chat template. Default: when the
            checkpoint has a template, as fine-tuned chat models do; pass false to complete the raw text.
        dtype: Weights and compute dtype. Default: bfloat16 on a GPU that supports it, else float32.
    """
    check_sampling(temperature, top_k, top_p)
    model, tokenizer = open_model(checkpoint_dir, dtype)
    device = _device_of(model)

    if chat is None:
        chat = tokenizer.chat_template is not None
    if chat:
        if tokenizer.chat_template is None:
            raise LitsftError(
                f"{checkpoint_dir} has no chat template; pass --chat false to complete the raw prompt"
            )
        text = tokenizer.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_bos=False)  # the template writes bos when the model wants one
    else:
        prompt_ids = tokenizer.encode(prompt)

    generator = torch.Generator(device).manual_seed(seed)
    start = time.perf_counter()
    new_ids = generate_tokens(
        model,
        torch.tensor(prompt_ids),
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        tokenizer.stop_ids,
        generator,
    )
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(new_ids.tolist()))
    mode = "chat template applied" if chat else "raw prompt"
    print(
        f"[{mode}; {new_ids.numel()} tokens in {elapsed:.2f}s, {new_ids.numel() / elapsed:.1f} tokens/s]",
        file=sys.stderr,
    )
