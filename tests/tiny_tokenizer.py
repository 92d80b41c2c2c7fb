"""A tiny byte-level BPE tokenizer, trained in milliseconds, laid out on disk the way Hugging Face
checkpoints lay theirs out. Tests write it into tiny model directories so nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<pad>"
# Every tokenizer gets every special token, whatever its template, so token ids do not depend on it.
SPECIAL_TOKENS = [
    BOS_TOKEN,
    EOS_TOKEN,
    "<|im_start|>",
    "<|im_end|>",
    PAD_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# Qwen2-Instruct's template in Qwen2.5's multi-line layout, so whitespace control matters when rendering.
CHATML_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE}
# The extra stop token each family lists in generation_config.json's eos_token_id.
EXTRA_STOP_TOKEN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

_WORDS = (
    "the a an one two three some many every small large quick slow red green blue old new cat dog bird "
    "fish tree river hill city house road model token answer question number story king queen child "
    "water light sound paper runs jumps sings reads writes sees finds makes takes gives counts adds "
    "and or but then because while after before with without over under near far here there today "
    "what who why how is are was were will can should could hello world please thank you yes no"
).split()


def _corpus(num_lines: int = 400) -> list[str]:
    """English-ish lines with digits and punctuation, the same on every call."""
    rng = random.Random(0)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        lines.append(line)
    return lines


def build_tiny_tokenizer(
    vocab_size: int = 512, add_bos: bool = False
) -> Tokenizer:  # the `tokenizers` object, before it is saved
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        # What Llama 3's tokenizer.json does: the post-processor prepends bos.
        bos_id = tokenizer.token_to_id(BOS_TOKEN)
        template = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    return tokenizer


def write_tiny_tokenizer(
    directory: Path,
    chat_template: Literal["chatml", "llama3"] | None = "chatml",
    vocab_size: int = 512,
    add_bos: bool | None = None,
) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json.

    Args:
        directory: Where to write them (created if missing).
        chat_template: "chatml" (Qwen-style, no bos), "llama3" (Llama-3-style, bos added and in the
            template), or None for a base model without a template.
        vocab_size: Upper bound on the vocabulary, special tokens included.
        add_bos: Whether encoding prepends bos; default: only for "llama3" and None, as in the real families.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if add_bos is None:
        add_bos = chat_template != "chatml"
    tokenizer = build_tiny_tokenizer(vocab_size, add_bos)
    tokenizer.save(str(directory / "tokenizer.json"))

    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = TEMPLATES[chat_template]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    eos_ids = [tokenizer.token_to_id(EOS_TOKEN)]
    if chat_template is not None:
        eos_ids.append(tokenizer.token_to_id(EXTRA_STOP_TOKEN[chat_template]))
    generation = {"bos_token_id": tokenizer.token_to_id(BOS_TOKEN), "eos_token_id": eos_ids}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
