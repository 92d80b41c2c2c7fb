"""`--data Demo`: a synthetic instruction set small models can learn in minutes, its held-out
exact-match evaluation, a matching plain-text corpus, and a tokenizer trained on them.

Every example is written by the generator below (no outside data): two-digit arithmetic, reversing or
sorting a few words, and changing their case. Answers are a few tokens long, so a 4-layer model trained
from scratch on a CPU gets a visible share of the held-out prompts exactly right.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from litsft.data.base import SFTDataModule
from litsft.data.chat import PROMPT_STYLES, Message
from litsft.data.records import to_conversation
from litsft.errors import LitsftError, check_number

GENERATOR_VERSION = 2
WORDS = (
    "apple bird boat cake corn desk door duck fig fish frog gold hat hill key kite lamp leaf lime milk "
    "moon nest owl pear pig pine rain ring rose salt sand ship sock star sun tea tree wolf wind yarn"
).split()
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def _words(rng: random.Random, low: int, high: int) -> list[str]:
    return rng.sample(WORDS, rng.randint(low, high))


DemoTask = Literal["add", "subtract", "reverse", "sort", "upper", "lower"]
ALL_TASKS: tuple[DemoTask, ...] = ("add", "subtract", "reverse", "sort", "upper", "lower")


def _example(rng: random.Random, tasks: Sequence[DemoTask] = ALL_TASKS) -> dict[str, str]:
    """One instruction record of a task drawn from `tasks`."""
    task = rng.choice(tuple(tasks))
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"instruction": "Add the numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    if task == "subtract":
        a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
        return {"instruction": "Subtract the numbers.", "input": f"{a} - {b}", "output": str(a - b)}
    # A fixed word count per task keeps every answer token at a fixed distance from the word it comes
    # from, which a 4-layer model trained from scratch learns within a few hundred steps.
    words = _words(rng, 3, 3) if task in ("reverse", "sort") else _words(rng, 2, 2)
    if task == "reverse":
        return {
            "instruction": "Reverse the words.",
            "input": " ".join(words),
            "output": " ".join(words[::-1]),
        }
    if task == "sort":
        return {"instruction": "Sort the words.", "input": " ".join(words), "output": " ".join(sorted(words))}
    if task == "upper":
        text = " ".join(words)
        return {"instruction": "Write the words in capitals.", "input": text, "output": text.upper()}
    text = " ".join(words)
    return {"instruction": "Write the words in lower case.", "input": text.upper(), "output": text}


def generate_examples(
    count: int, seed: int = 0, tasks: Sequence[DemoTask] = ALL_TASKS
) -> list[dict[str, str]]:
    """`count` instruction records ({"instruction", "input", "output"}) with distinct prompts; the same
    list for the same arguments."""
    rng = random.Random(f"litsft-demo-{GENERATOR_VERSION}-{seed}")
    seen: set[tuple[str, str]] = set()
    examples = []
    while len(examples) < count:
        example = _example(rng, tasks)
        key = (example["instruction"], example["input"])
        if key not in seen:
            seen.add(key)
            examples.append(example)
    return examples


def demo_splits(
    num_train: int, num_val: int, num_eval: int, seed: int = 0, tasks: Sequence[DemoTask] = ALL_TASKS
) -> dict[str, list[dict[str, str]]]:
    """Disjoint train / val / eval records: no held-out prompt appears in training."""
    examples = generate_examples(num_eval + num_val + num_train, seed, tasks)
    return {
        "eval": examples[:num_eval],
        "val": examples[num_eval : num_eval + num_val],
        "train": examples[num_eval + num_val :],
    }


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Share of predictions equal to their reference, ignoring surrounding whitespace."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        return 0.0
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)


def corpus_text(example: dict[str, str]) -> str:
    """An example as a plain-text document, for pretraining."""
    return f"{example['instruction']}\n{example['input']}\n{example['output']}\n"


def write_demo_corpus(
    directory: Path, num_examples: int = 20_000, num_files: int = 4, seed: int = 0
) -> list[Path]:
    """The training examples of `demo_splits` as plain text, `num_files` .txt files, one blank line
    between examples; for `--data TextFiles --data.train_data_path <directory>`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    examples = generate_examples(num_examples, seed)
    paths = []
    for i in range(num_files):
        path = directory / f"demo-{i:03d}.txt"
        path.write_text(
            "\n".join(corpus_text(example) for example in examples[i::num_files]), encoding="utf-8"
        )
        paths.append(path)
    return paths


def build_demo_tokenizer(directory: Path, vocab_size: int = 512, seed: int = 0) -> None:
    """Train a byte-level BPE tokenizer on demo text and write tokenizer.json, tokenizer_config.json
    (ChatML specials and template), special_tokens_map.json and generation_config.json into `directory`.

    Digits are single tokens, so sums are written digit by digit; every demo word, in both cases and
    with or without a leading space, is one token. Only printable ASCII text can be encoded.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        # Printable ASCII (in ByteLevel's spelling: space is Ġ, newline Ċ) rather than all 256 bytes,
        # which would leave too few merges for one token per word; other characters are not encoded.
        initial_alphabet=[chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_training_text(seed), trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT}
    config = {
        **special,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": PROMPT_STYLES["chatml"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    stop_ids = [tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_ids}, indent=2) + "\n")


def _tokenizer_training_text(seed: int) -> Iterator[str]:
    # Both forms the tokenizer will meet: plain text and ChatML conversations. Every word in both
    # cases, so each becomes one token even if the sample below happens to miss it.
    yield " ".join(WORDS) + "\n" + " ".join(WORDS).upper()
    for example in generate_examples(4000, seed + 1):
        yield corpus_text(example)
        conversation = to_conversation(example)
        yield "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in conversation)


@dataclass(kw_only=True)
class Demo(SFTDataModule):
    """Synthetic instructions (arithmetic, reversing/sorting words, case changes) with held-out
    prompts and an exact-match score, to see in minutes that training works."""

    num_train: int = 20_000
    """Training examples generated."""
    num_val: int = 200
    """Validation examples (loss only)."""
    num_eval: int = 100
    """Held-out prompts for exact match (`eval_prompts`), never in train or val."""
    generator_seed: int = 0
    """Seed of the generator: another seed, another data set."""
    tasks: list[DemoTask] = field(default_factory=lambda: ["reverse", "sort", "upper", "lower"])
    """Which tasks to generate: reverse, sort, upper, lower (a tiny model learns these in minutes) and
    add, subtract (two-digit arithmetic, which takes much longer)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tasks:
            raise LitsftError(f"Demo: --data.tasks is empty; choose from {', '.join(ALL_TASKS)}")
        check_number("--data.num_train", self.num_train, at_least=1)
        check_number("--data.num_val", self.num_val, at_least=0, fix="0 for no validation")
        check_number("--data.num_eval", self.num_eval, at_least=0)

    def sources(self) -> dict[str, tuple[str, Callable[..., list[list[Message]]]]]:
        identity = (
            f"demo:v{GENERATOR_VERSION}:{self.num_train}:{self.num_val}:{self.num_eval}:{self.generator_seed}:"
            f"{','.join(self.tasks)}"
        )
        return {
            split: (f"{identity}:{split}", partial(self._conversations, split)) for split in ("train", "val")
        }

    def _conversations(self, split: str, limit: int | None = None) -> list[list[Message]]:
        records = demo_splits(self.num_train, self.num_val, self.num_eval, self.generator_seed, self.tasks)[
            split
        ]
        return [to_conversation(record) for record in records[:limit]]

    def eval_prompts(self) -> list[tuple[list[Message], str]]:
        """Held-out (messages without the reply, expected reply) pairs. Render with
        `tokenizer.render_chat(messages, add_generation_prompt=True)`, generate, decode, `exact_match`."""
        records = demo_splits(self.num_train, self.num_val, self.num_eval, self.generator_seed, self.tasks)[
            "eval"
        ]
        return [(to_conversation(record)[:-1], record["output"]) for record in records]

    exact_match = staticmethod(exact_match)
