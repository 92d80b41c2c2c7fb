"""`litsft chat`: a multi-turn conversation with a model through its own chat template, one user message per
line of input, each reply streamed as it is generated. Each turn renders the whole conversation so far, as
training rendered it, so what the model sees is what it was trained on."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import torch

from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError
from litsft.inference.generate import Dtype, check_sampling, generate_tokens, open_model

RESET, EXIT = "/reset", "/exit"


class TextStream:
    """The text of tokens given one at a time, as pieces to print: each new token's text once the tokenizer
    can decode it whole (a character split over several byte tokens waits for its last byte)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return ""  # an incomplete character, or a decoding that changes what came before: wait
        piece, self.printed = text[len(self.printed) :], text
        return piece

    def print_token(self, token: int) -> None:
        """`push` the token and print what it completes, at once (stdout)."""
        print(self.push(token), end="", flush=True)

    def rest(self) -> str:
        """What is left to print once the reply is complete."""
        text = self.tokenizer.decode(self.ids)
        return text[len(self.printed) :] if text.startswith(self.printed) else ""


def user_messages(interactive: bool) -> Iterator[str]:
    """Lines of standard input, with a prompt on stderr when a person types them."""
    while True:
        try:
            line = input(">> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return
        yield line.rstrip("\n")


def chat(
    checkpoint_dir: str,  # not Path, which would drop the ./ that marks a local directory
    system_prompt: str | None = None,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 1234,
    dtype: Dtype | None = None,
) -> None:
    """Talk with a model, turn by turn, through its chat template.

    Each line of input is a user message; the reply is printed as it is generated. /reset starts the
    conversation over (the system prompt kept), /exit or the end of input ends it.

    Args:
        checkpoint_dir: The model, as `litsft generate` takes it: a checkpoint, a run's final/ (LoRA's with its
            base), an HF model folder or a hub id.
        system_prompt: The system message that opens the conversation (and every conversation after /reset).
        max_new_tokens: At most this many tokens a reply; a reply also ends at an end-of-turn token.
        temperature: 0 for greedy decoding (deterministic); e.g. 0.7 to sample.
        top_k: When sampling, pick only among the k most likely tokens.
        top_p: When sampling, pick only among the most likely tokens whose probabilities sum to top_p.
        seed: Random seed for sampling.
        dtype: Weights and compute dtype. Default: bfloat16 on a GPU that supports it, else float32.
    """
    check_sampling(temperature, top_k, top_p)
    model, tokenizer = open_model(checkpoint_dir, dtype)
    if tokenizer.chat_template is None:
        raise LitsftError(
            f"{checkpoint_dir} has no chat template to hold a conversation with; use `litsft generate --chat "
            "false` to complete raw text"
        )
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {checkpoint_dir}: {RESET} starts over, {EXIT} or Ctrl-D ends.", file=sys.stderr)
    opening = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(opening)
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    context = model.config.max_position_embeddings
    for line in user_messages(interactive):
        if line.strip() == EXIT:
            return
        if line.strip() == RESET:
            messages = list(opening)
            print("[conversation reset]", file=sys.stderr, flush=True)
            continue
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True), add_bos=False)
        budget = min(max_new_tokens, context - len(prompt))
        if budget <= 0:
            messages.pop()
            print(
                f"[the conversation is {len(prompt):,} tokens, the model's context {context:,}: {RESET} to start "
                "over]",
                file=sys.stderr,
                flush=True,
            )
            continue
        stream = TextStream(tokenizer)
        started = time.perf_counter()
        new_ids = generate_tokens(
            model,
            torch.tensor(prompt),
            budget,
            temperature,
            top_k,
            top_p,
            tokenizer.stop_ids,
            generator,
            on_token=stream.print_token,
        )
        print(stream.rest(), flush=True)
        reply = tokenizer.decode(new_ids.tolist())
        messages.append({"role": "assistant", "content": reply})
        if interactive:
            seconds = time.perf_counter() - started
            print(f"[{new_ids.numel()} tokens, {new_ids.numel() / seconds:.1f} tokens/s]", file=sys.stderr)
