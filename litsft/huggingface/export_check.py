"""Does the exported model still talk like the litsft model? After `convert_to_hf`, a few prompts are rendered
with the chat template and answered greedily by litsft and, from the exported folder, by transformers; the
first difference is named in one line: the chat template (rendered text), the tokenizer or special tokens
(token ids of the same text), end of turn (the tokens generation stops at), or the weights (the generated
tokens). Exported models that talk nonsense because the chat template or the end-of-turn token was lost on the
way are reported by users of other fine-tuning tools (NeMo AutoModel #1099, unsloth #1593 and #1832): this
catches them when the export is made, not after it ships."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from litsft.checkpoint.checkpoint_dirs import VALIDATION_PROMPTS_FILE
from litsft.checkpoint.model_loader import load_model
from litsft.data.tokenizer import Tokenizer
from litsft.model.network.transformer import Transformer

CHECK_PROMPTS = ("Hello! Who are you?", "What is 2 + 3? Answer in one word.")
"""Asked when the checkpoint holds no validation prompts of its own (VALIDATION_PROMPTS_FILE: a training run's
first validation conversations, up to their first reply, so that an export is checked on what the model was
trained to answer)."""
CHECK_PROMPT_TOKENS = 512
"""The longest prompt a run keeps for the check: `greedy` feeds the whole sequence at every new token."""
CHECK_NEW_TOKENS = 16
CHEAP_PARAMETERS = 2_000_000_000
"""`--check auto` runs the check up to this many parameters: two fp32 copies of a 2B model (16 GB of host memory)
answer two prompts in seconds to a minute on a CPU."""


Conversation = list[dict[str, str]]


def check_prompts(checkpoint_dir: Path) -> list[Conversation]:
    """The conversations the export check asks: the run's validation prompts kept in the checkpoint, else
    CHECK_PROMPTS as user messages."""
    kept = checkpoint_dir / VALIDATION_PROMPTS_FILE
    if kept.is_file():
        conversations = json.loads(kept.read_text(encoding="utf-8"))
        if conversations:
            return conversations
    return [[{"role": "user", "content": prompt}] for prompt in CHECK_PROMPTS]


def check_export(checkpoint_dir: Path, hf_dir: Path, prompts: list[Conversation] | None = None) -> str | None:
    """What differs between the litsft model of `checkpoint_dir` (a LoRA folder: its base with the adapters)
    and its export in `hf_dir` loaded by transformers, as one line; None when both render, encode and answer
    every prompt (default: `check_prompts(checkpoint_dir)`) alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the verdict is the one line this prints
    ours_tokenizer = Tokenizer(checkpoint_dir)
    theirs_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ours_stops = sorted(ours_tokenizer.stop_ids)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    theirs_stops = model.generation_config.eos_token_id
    theirs_stops = sorted([theirs_stops] if isinstance(theirs_stops, int) else theirs_stops or [])
    if ours_stops != theirs_stops:
        return (
            f"end of turn: litsft stops generating at token ids {ours_stops}, the export's generation_config.json "
            f"at {theirs_stops}; generation would not stop where the model was trained to"
        )
    litsft_model = load_model(checkpoint_dir, torch.device("cpu"), torch.float32)
    for messages in prompts if prompts is not None else check_prompts(checkpoint_dir):
        text = messages[-1]["content"]
        label = text if len(text) <= 60 else text[:57] + "..."  # what a difference is reported by
        if ours_tokenizer.chat_template is None:
            ours_ids = ours_tokenizer.encode(text)
            theirs_ids = theirs_tokenizer(text)["input_ids"]
        else:
            if not theirs_tokenizer.chat_template:
                return (
                    "chat template: the export has none (its tokenizer_config.json and chat_template.jinja)"
                )
            ours_text = ours_tokenizer.render_chat(messages, add_generation_prompt=True)
            theirs_text = theirs_tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            if ours_text != theirs_text:
                at = next((i for i, (a, b) in enumerate(zip(ours_text, theirs_text)) if a != b), None)
                at = min(len(ours_text), len(theirs_text)) if at is None else at
                return (
                    f"chat template: the export renders {label!r} as {theirs_text[at : at + 30]!r} from character "
                    f"{at}, litsft as {ours_text[at : at + 30]!r}"
                )
            ours_ids = ours_tokenizer.encode(ours_text, add_bos=False)
            theirs_ids = theirs_tokenizer(theirs_text, add_special_tokens=False)["input_ids"]
        if ours_ids != theirs_ids:
            return (
                f"tokenizer or special tokens: the same prompt is {len(ours_ids)} token ids in litsft, "
                f"{len(theirs_ids)} in the export, first different at position "
                f"{next((i for i, (a, b) in enumerate(zip(ours_ids, theirs_ids)) if a != b), min(len(ours_ids), len(theirs_ids)))}"
            )
        ours_new = greedy(litsft_model, ours_ids, set(ours_stops))
        with torch.no_grad():
            output = model.generate(
                torch.tensor([theirs_ids]),
                max_new_tokens=CHECK_NEW_TOKENS,
                do_sample=False,
                top_p=None,
                top_k=None,
            )
        theirs_new = [token for token in output[0, len(theirs_ids) :].tolist() if token not in theirs_stops]
        if ours_new != theirs_new:
            at = next((i for i, (a, b) in enumerate(zip(ours_new, theirs_new)) if a != b), None)
            return (
                f"weights: for {label!r} the export generates {theirs_new[at] if at is not None else 'nothing'} "
                f"where litsft generates {ours_new[at] if at is not None else 'more'} (new token {at})"
            )
    return None


@torch.no_grad()
def greedy(model: Transformer, prompt: list[int], stops: set[int]) -> list[int]:
    """Up to CHECK_NEW_TOKENS greedy tokens after `prompt`, the stop token left out: the whole sequence fed
    again at every step, which needs nothing but the model's forward pass."""
    ids, new = list(prompt), []
    for _ in range(CHECK_NEW_TOKENS):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        if token in stops:
            break
        new.append(token)
        ids.append(token)
    return new
