"""The demo data, its tokenizer and its exact-match score (litsft/data/demo.py)."""

from __future__ import annotations

import random

import pytest

from litsft.data import Demo, build_demo_tokenizer, exact_match, write_demo_corpus
from litsft.data.demo import ALL_TASKS, WORDS, corpus_text, demo_splits, generate_examples
from litsft.data.loader import collate
from litsft.data.tokenizer import Tokenizer


def padding_efficiency(loader) -> float:
    """Fraction of positions in an epoch's batches (all ranks) that hold a sample token, not padding."""
    used = padded = 0
    for rank in range(loader.world_size):
        for rows in loader.micro_batches(None, rank):
            lengths = [int(loader.positions[row].sum()) for row in rows]
            used += sum(lengths)
            padded += len(rows) * (loader.max_seq_length if loader.packing else max([1, *lengths]))
    return used / padded if padded else 0.0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo-tokenizer")
    build_demo_tokenizer(directory)
    return Tokenizer(directory)


def check_answer(example: dict[str, str]) -> bool:
    instruction, text, output = example["instruction"], example["input"], example["output"]
    if instruction == "Add the numbers.":
        a, b = text.split(" + ")
        return output == str(int(a) + int(b))
    if instruction == "Subtract the numbers.":
        a, b = text.split(" - ")
        return output == str(int(a) - int(b))
    words = text.split()
    return {
        "Reverse the words.": " ".join(words[::-1]),
        "Sort the words.": " ".join(sorted(words)),
        "Write the words in capitals.": text.upper(),
        "Write the words in lower case.": text.lower(),
    }[instruction] == output


def test_examples_are_right_distinct_and_repeatable():
    examples = generate_examples(3000, seed=1)
    assert examples == generate_examples(3000, seed=1)
    assert examples != generate_examples(3000, seed=2)
    assert all(check_answer(example) for example in examples)
    assert len({(e["instruction"], e["input"]) for e in examples}) == 3000
    assert len({e["instruction"] for e in examples}) == 6


def test_held_out_prompts_are_not_trained_on():
    splits = demo_splits(num_train=2000, num_val=50, num_eval=100)
    keys = {name: {(e["instruction"], e["input"]) for e in split} for name, split in splits.items()}
    assert [len(keys[name]) for name in ("train", "val", "eval")] == [2000, 50, 100]
    assert not keys["eval"] & (keys["train"] | keys["val"]) and not keys["val"] & keys["train"]
    prompts = Demo(num_train=2000, num_val=50, num_eval=100, tasks=list(ALL_TASKS)).eval_prompts()
    assert len(prompts) == 100
    messages, answer = prompts[0]
    assert [m["role"] for m in messages] == ["user"] and answer == splits["eval"][0]["output"]


def test_exact_match():
    assert exact_match(["42", " sun cat\n", "FIG"], ["42", "sun cat", "fig"]) == pytest.approx(2 / 3)
    assert Demo.exact_match([], []) == 0.0
    with pytest.raises(ValueError):
        exact_match(["a"], [])


def test_demo_tokenizer(tokenizer):
    assert tokenizer.vocab_size <= 512
    assert (tokenizer.bos_id, tokenizer.add_bos) == (None, False)
    assert tokenizer.decode(tokenizer.stop_ids, skip_special_tokens=False) == "<|endoftext|><|im_end|>"
    for word in WORDS:
        for form in (word, " " + word, word.upper(), " " + word.upper()):
            assert len(tokenizer.encode(form)) == 1, form
    assert [tokenizer.decode([i]) for i in tokenizer.encode("1234")] == ["1", "2", "3", "4"]
    example = generate_examples(1)[0]
    assert tokenizer.decode(tokenizer.encode(corpus_text(example))) == corpus_text(example)
    messages, _ = Demo().eval_prompts()[0]
    assert tokenizer.render_chat(messages, add_generation_prompt=True) == (
        f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_answers_are_short(tokenizer):
    lengths = [len(tokenizer.encode(e["output"])) for e in generate_examples(500)]
    assert max(lengths) <= 10


def test_packing_efficiency_on_the_demo_data(tmp_path, tokenizer):
    data = Demo(num_train=2000, num_val=20, num_eval=10, cache_dir=tmp_path)
    data.connect(tokenizer, max_seq_length=256, seed=0)
    data.prepare()
    data.setup()
    packed = padding_efficiency(data.train_dataloader(0, 1, 8, 16))
    data.packing = False
    grouped_loader = data.train_dataloader(0, 1, 8, 16)
    grouped = padding_efficiency(grouped_loader)
    # Padding to the longest sample of a random batch, without length grouping.
    order = random.Random(0).sample(range(len(data.train_samples)), len(data.train_samples))
    used = padded = 0
    for start in range(0, len(order) - 7, 8):
        positions = data.train_samples.lengths[order[start : start + 8]] - 1
        batch = collate(data.train_samples, [[i] for i in order[start : start + 8]], None, 0)
        assert batch["input_ids"].shape == (8, positions.max())
        used, padded = used + int(positions.sum()), padded + batch["input_ids"].numel()
    print(
        f"non-padding share: packed {packed:.4f}, length-grouped {grouped:.4f}, random batches {used / padded:.4f}"
    )
    assert packed >= 0.95
    assert used / padded < packed


def test_corpus_files(tmp_path):
    paths = write_demo_corpus(tmp_path, num_examples=10, num_files=3)
    assert [p.name for p in paths] == ["demo-000.txt", "demo-001.txt", "demo-002.txt"]
    examples = generate_examples(10)
    assert paths[1].read_text() == "\n".join(corpus_text(e) for e in examples[1::3])
