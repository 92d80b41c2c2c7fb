"""Preference pairs as data (litsft/data/pairs.py, ChatFormat(pairs=True), SFTLoader(samples_per_unit=2)): a pair
tokenizes to two samples (chosen, then rejected) whose replies alone carry loss, is truncated whole (the prompt's
start first, then the replies' ends), and is dealt whole: never split across rows' micro-batches or ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from litsft.data.chat import ChatFormat, ConversationError, PreferencePair
from litsft.data.loader import PAD_DOCUMENT_ID, SFTLoader
from litsft.data.pairs import PairTruncation, pair_positions, pair_samples, truncate_pairs
from litsft.data.records import to_conversation
from litsft.data.samples import Samples, first_targets_of
from litsft.data.tokenizer import Tokenizer


def pair_store(shapes: list[tuple[int, int, int]], seed: int = 0) -> Samples:
    """Pairs of (prompt, chosen reply, rejected reply) token counts as samples 2k (prompt + chosen) and
    2k + 1 (the same prompt tokens + rejected), the replies' tokens the only targets."""
    rng = np.random.default_rng(seed)
    tokens, targets, lengths = [], [], []
    for prompt_length, *replies in shapes:
        prompt = rng.integers(0, 512, prompt_length, dtype=np.int32)
        for reply_length in replies:
            tokens += [prompt, rng.integers(0, 512, reply_length, dtype=np.int32)]
            targets += [np.zeros(prompt_length, bool), np.ones(reply_length, bool)]
            lengths.append(prompt_length + reply_length)
    return Samples.back_to_back(np.concatenate(tokens), np.concatenate(targets), np.asarray(lengths))


def sample_tokens(samples: Samples, index: int) -> list[int]:
    return samples.sample(index)[0].tolist()


# ---- truncate_pairs ------------------------------------------------------------------------------------


def test_a_pair_that_fits_is_left_untouched() -> None:
    samples = pair_store([(6, 4, 9), (3, 2, 2)])
    fits = int(pair_positions(samples).max())
    assert pair_positions(samples).tolist() == [(10 - 1) + (15 - 1), (5 - 1) + (5 - 1)]
    truncated, report = truncate_pairs(samples, fits)
    for name in ("starts", "lengths", "first_targets"):
        assert getattr(truncated, name).tolist() == getattr(samples, name).tolist(), name
    assert report == PairTruncation(pairs=2)
    assert report.notice(fits) is None


def test_an_over_long_pair_loses_the_start_of_its_prompt_the_same_in_both_samples() -> None:
    """Prompt 10, replies 5 and 7: 14 + 16 = 30 positions. In 25, both samples lose their prompt's first 3 tokens
    (5 too many, 2 positions a prompt token): the prompt's last 7 tokens and both replies whole are kept."""
    samples = pair_store([(10, 5, 7), (2, 1, 1)])
    truncated, report = truncate_pairs(samples, 25)
    for index in (0, 1):
        original = sample_tokens(samples, index)
        assert sample_tokens(truncated, index) == original[3:]  # the prompt's end, the reply whole
        kept_targets = truncated.sample(index)[1]
        assert kept_targets.tolist() == [False] * 7 + [True] * (len(original) - 10)
    assert truncated.first_targets[:2].tolist() == [7, 7]
    assert (samples.lengths[:2] - truncated.lengths[:2]).tolist() == [3, 3]
    assert pair_positions(truncated).tolist() == [24, 4]
    assert sample_tokens(truncated, 2) == sample_tokens(samples, 2)  # the short pair: untouched
    assert report == PairTruncation(pairs=2, truncated=1, prompt_tokens=3, reply_tokens=0, dropped=0)


def test_when_the_prompt_cannot_absorb_the_excess_the_replies_ends_are_cut() -> None:
    """Prompt 3, replies 20 and 30 (54 positions) in 20: the prompt keeps one token (2 cut), then each reply is
    cut at its end to half a row (10 positions, 11 tokens each: the kept prompt token and 10 reply tokens)."""
    samples = pair_store([(3, 20, 30)])
    truncated, report = truncate_pairs(samples, 20)
    for index in (0, 1):
        original = sample_tokens(samples, index)
        assert sample_tokens(truncated, index) == original[2:13]  # the last prompt token, the reply's start
    assert truncated.first_targets.tolist() == [1, 1]
    assert pair_positions(truncated).tolist() == [20]
    assert report == PairTruncation(pairs=1, truncated=1, prompt_tokens=2, reply_tokens=10 + 20)
    # A short reply is kept whole and the long one gets the rest of the row.
    lopsided, _ = truncate_pairs(pair_store([(3, 4, 30)]), 20)
    assert (lopsided.lengths - 1).tolist() == [4, 16] and pair_positions(lopsided).tolist() == [20]


@pytest.mark.parametrize("seed", range(4))
def test_every_truncated_pair_fits_and_is_cut_prompt_first(seed: int) -> None:
    """Random pairs in random rows: each kept sample is a contiguous piece of its original, both samples of a
    pair lose the same prompt tokens (at least one kept), the fewest that fit, and reply ends only once the
    prompt is down to one token, each sample keeping half a row where it can; targets stay where they were."""
    rng = np.random.default_rng(seed)
    shapes = [tuple(int(n) for n in rng.integers(1, 40, 3)) for _ in range(50)]
    samples = pair_store(shapes, seed)
    max_positions = int(rng.integers(4, 60))
    truncated, report = truncate_pairs(samples, max_positions)
    assert len(truncated) == 2 * (report.pairs - report.dropped) and report.dropped == 0
    assert (pair_positions(truncated) <= max_positions).all()
    np.testing.assert_array_equal(
        truncated.first_targets,
        first_targets_of(truncated.targets, truncated.starts.astype(np.int64), truncated.lengths),
    )
    cut_prompts = cut_replies = 0
    for pair, (prompt, *replies) in enumerate(shapes):
        positions = sum(prompt + reply - 1 for reply in replies)
        start_cuts, end_cuts = [], []
        for i in (2 * pair, 2 * pair + 1):  # nothing is dropped: sample i is still sample i
            start_cut = int(truncated.starts[i] - samples.starts[i])
            start_cuts.append(start_cut)
            end_cuts.append(int(samples.lengths[i]) - start_cut - int(truncated.lengths[i]))
            # Each sample keeps half a row where it has that much.
            kept = int(truncated.lengths[i]) - 1
            assert kept >= min(int(samples.lengths[i]) - 1 - start_cut, max_positions // 2)
        assert start_cuts[0] == start_cuts[1] and 0 <= start_cuts[0] <= prompt - 1
        assert min(end_cuts) >= 0
        cut = start_cuts[0]
        if any(end_cuts):
            assert cut == prompt - 1, "a reply was cut while the prompt had tokens to spare"
        else:  # the fewest prompt tokens that make it fit
            assert positions - 2 * cut <= max_positions
            assert cut == 0 or positions - 2 * (cut - 1) > max_positions
        cut_prompts += cut
        cut_replies += sum(end_cuts)
    assert (report.prompt_tokens, report.reply_tokens) == (cut_prompts, cut_replies)
    assert report.truncated == sum(
        sum(prompt + reply - 1 for reply in replies) > max_positions for prompt, *replies in shapes
    )


def test_a_pair_left_without_a_target_is_dropped_and_counted() -> None:
    """A pair whose rejected sample's first target lies far past its chosen's (its "prompt" longer): with its
    prompt cut to the chosen's one token, the 8 positions left to the rejected sample hold no target."""
    tokens, targets, lengths = [], [], []
    for prompt, reply in [(3, 2), (3, 3), (2, 4), (12, 8)]:  # pair 0 fits; pair 1 cannot keep a target
        tokens.append(np.arange(prompt + reply, dtype=np.int32))
        targets.append(np.arange(prompt + reply) >= prompt)
        lengths.append(prompt + reply)
    samples = Samples.back_to_back(np.concatenate(tokens), np.concatenate(targets), np.asarray(lengths))
    truncated, report = truncate_pairs(samples, 12)
    assert len(truncated) == 2
    assert [sample_tokens(truncated, i) for i in (0, 1)] == [sample_tokens(samples, i) for i in (0, 1)]
    assert report == PairTruncation(pairs=2, truncated=1, prompt_tokens=1, reply_tokens=10, dropped=1)
    notice = report.notice(12)
    assert notice is not None
    assert "Truncated 1 of 2 preference pairs" in notice
    assert "max_seq_length=12" in notice
    assert "1 tokens cut from the starts of their prompts" in notice
    assert "10 from the ends of their replies" in notice
    assert "1 pairs left without a reply token dropped" in notice


def test_the_notice_counts_what_was_cut() -> None:
    report = truncate_pairs(pair_store([(10, 5, 7), (3, 20, 30), (2, 1, 1)]), 20)[1]
    assert (report.pairs, report.truncated, report.dropped) == (3, 2, 0)
    notice = report.notice(20)
    assert notice.startswith("Truncated 2 of 3 preference pairs to fit both replies in max_seq_length=20")
    assert f"{report.prompt_tokens} tokens cut from the starts" in notice
    assert f"{report.reply_tokens} from the ends of their replies" in notice
    assert "dropped" not in notice
    assert notice.endswith("raise --train.max_seq_length to train on them whole")


def test_pair_samples_of_indices_and_of_a_mask() -> None:
    assert pair_samples(np.array([0, 2, 5])).tolist() == [0, 1, 4, 5, 10, 11]
    assert pair_samples(np.array([True, False, True])).tolist() == [0, 1, 4, 5]
    assert pair_samples(np.array([False, False])).tolist() == []
    assert pair_samples(np.zeros(0, np.int64)).tolist() == []


# ---- ChatFormat(pairs=True) ------------------------------------------------------------------------------

PROMPT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And the red cat?"},
]
CHOSEN = "The cat sings today!"
REJECTED = "Blue river, slow king."


def split_samples(tokenized) -> list[tuple[list[int], list[bool]]]:
    tokens, targets, lengths, _ = tokenized
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [(tokens[a:b].tolist(), targets[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]


def test_a_pair_is_two_samples_whose_replies_alone_are_targets(tokenizer: Tokenizer) -> None:
    chat_format = ChatFormat(tokenizer, pairs=True)
    record = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    pair = to_conversation(record)
    assert isinstance(pair, PreferencePair)
    tokenized = chat_format.tokenize_many([pair, pair])
    samples = split_samples(tokenized)
    assert len(samples) == 4 and samples[2:] == samples[:2]
    prompt_text = chat_format.render(PROMPT, add_generation_prompt=True)
    prompt_tokens = tokenizer.encode(prompt_text, add_bos=False)
    for (tokens, targets), reply in zip(samples, (CHOSEN, REJECTED)):
        conversation = [*PROMPT, {"role": "assistant", "content": reply}]
        assert tokens == tokenizer.encode(chat_format.render(conversation), add_bos=False)
        assert tokens[: len(prompt_tokens)] == prompt_tokens  # the same prompt tokens in both samples
        assert not any(targets[: len(prompt_tokens)])
        target_ids = [t for t, is_target in zip(tokens, targets) if is_target]
        assert tokenizer.decode(target_ids, skip_special_tokens=False) == reply + "<|im_end|>"
        # The targets are one run right after the prompt: the reply and its end-of-turn token.
        first = targets.index(True)
        assert first == len(prompt_tokens) and all(targets[first : first + len(target_ids)])
    # The earlier assistant turn of the prompt is no target (whatever mask_prompt says).
    unmasked = ChatFormat(tokenizer, mask_prompt=False, pairs=True).tokenize_many([pair])
    assert split_samples(unmasked) == samples[:2]


def test_two_whole_conversations_are_read_as_their_shared_prompt_and_replies(tokenizer: Tokenizer) -> None:
    chat_format = ChatFormat(tokenizer, pairs=True)
    explicit = {
        "prompt": PROMPT,
        "chosen": [{"role": "assistant", "content": CHOSEN}],
        "rejected": [{"role": "assistant", "content": REJECTED}],
    }
    implicit = {
        "chosen": [*PROMPT, {"role": "assistant", "content": CHOSEN}],
        "rejected": [*PROMPT, {"role": "assistant", "content": REJECTED}],
    }
    strings = {"prompt": "What is 2 + 3?", "chosen": CHOSEN, "rejected": REJECTED}
    implicit_strings = {
        "chosen": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": CHOSEN}],
        "rejected": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": REJECTED},
        ],
    }
    pairs = [to_conversation(record) for record in (explicit, implicit, strings, implicit_strings)]
    assert list(pairs[1]) == PROMPT and pairs[1].chosen == explicit["chosen"]
    assert pairs[1].rejected == explicit["rejected"]
    tokenized = [split_samples(chat_format.tokenize_many([pair])) for pair in pairs]
    assert tokenized[1] == tokenized[0]
    assert tokenized[3] == tokenized[2]
    assert tokenized[2] != tokenized[0]


def test_a_pair_with_the_same_reply_twice_is_skipped_and_counted(tokenizer: Tokenizer) -> None:
    records = [
        {"prompt": "Hello?", "chosen": "Yes.", "rejected": "No."},
        {"prompt": "Hello?", "chosen": "Yes.", "rejected": "Yes."},
        {"prompt": "Why?", "chosen": "Because.", "rejected": "Then."},
    ]
    pairs = [to_conversation(record) for record in records]
    skipping = ChatFormat(tokenizer, skip_invalid=True, pairs=True).tokenize_many(pairs)
    tokens, _, lengths, report = skipping
    assert len(lengths) == 4 and int(lengths.sum()) == len(tokens)
    assert report.conversations == 3
    assert [index for index, _ in report.skipped] == [1]
    assert "chosen and rejected are the same reply" in report.skipped[0][1]
    kept = ChatFormat(tokenizer, pairs=True).tokenize_many([pairs[0], pairs[2]])
    assert split_samples(kept) == split_samples(skipping)
    with pytest.raises(ConversationError) as refused:
        ChatFormat(tokenizer, pairs=True).tokenize_many(pairs)
    assert refused.value.index == 1


def test_a_conversation_in_pair_data_and_a_pair_in_sft_data_are_skipped_with_a_reason(
    tokenizer: Tokenizer,
) -> None:
    conversation = to_conversation({"messages": [*PROMPT, {"role": "assistant", "content": CHOSEN}]})
    pair = to_conversation({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    _, _, lengths, report = ChatFormat(tokenizer, skip_invalid=True, pairs=True).tokenize_many(
        [conversation, pair]
    )
    assert len(lengths) == 2 and [index for index, _ in report.skipped] == [0]
    assert report.skipped[0][1].startswith("not a preference pair")
    _, _, lengths, report = ChatFormat(tokenizer, skip_invalid=True).tokenize_many([pair, conversation])
    assert len(lengths) == 1 and [index for index, _ in report.skipped] == [0]
    assert "a preference pair ('chosen' and 'rejected') in SFT data" in report.skipped[0][1]


# ---- SFTLoader(samples_per_unit=2) ------------------------------------------------------------------------

PAIRS = 21


def loader_store() -> Samples:
    rng = np.random.default_rng(7)
    return pair_store([tuple(int(n) for n in rng.integers(2, 12, 3)) for _ in range(PAIRS)], seed=7)


def pair_loaders(
    packing: bool, micro_batch_size: int, shuffle: bool = True, seed: int = 3
) -> list[SFTLoader]:
    samples = loader_store()
    return [
        SFTLoader(
            samples,
            48,
            packing,
            0,
            rank,
            2,
            micro_batch_size,
            2 * micro_batch_size * 2,
            seed,
            shuffle=shuffle,
            samples_per_unit=2,
        )  # fmt: skip
        for rank in range(2)
    ]


def sequences_by_row(batch: dict[str, torch.Tensor], packed: bool) -> list[list[int]]:
    """The samples of each row of a collated pair batch, from its sequence_samples and document ids."""
    sequences = batch["sequence_samples"].tolist()
    if not packed:
        return [[i] if i >= 0 else [] for i in sequences]
    per_row = [len(set(row.tolist()) - {PAD_DOCUMENT_ID}) for row in batch["document_ids"]]
    bounds = np.concatenate([[0], np.cumsum(per_row)]).tolist()
    return [sequences[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["training", "ordered"])
def test_pairs_are_dealt_whole_to_micro_batches_and_ranks(packing: bool, shuffle: bool) -> None:
    micro_batch_size = 1 if packing else 2  # global batches of 4 packed rows, or of 8 pairs
    loaders = pair_loaders(packing, micro_batch_size, shuffle=shuffle)
    samples = loaders[0].samples
    values = np.random.default_rng(0).normal(size=len(samples))
    seen: list[int] = []
    for loader in loaders:
        loader.per_sample["reference_logps"] = values
        for batch in loader:
            sequences = batch["sequence_samples"].tolist()
            real = [i for i in sequences if i >= 0]
            assert len(sequences) % 2 == 0
            assert all(
                (a, b) == (a, a + 1) and a % 2 == 0
                for a, b in zip(sequences[0::2], sequences[1::2])
                if a >= 0
            ), sequences
            assert all(b < 0 for a, b in zip(sequences[0::2], sequences[1::2]) if a < 0)
            seen += real
            # Each sequence's target count and value, 0 for a filler.
            for i, count, value in zip(
                sequences, batch["sequence_targets"].tolist(), batch["reference_logps"].tolist()
            ):
                if i < 0:
                    assert (count, value) == (0, 0)
                else:
                    assert count == int(samples.sample(i)[1][1:].sum()) and value == values[i]
            rows = sequences_by_row(batch, packing)
            if packing:  # both samples of a pair are documents of one row
                for row in rows:
                    assert row == [i for a in row[0::2] for i in (a, a + 1)], row
            else:
                assert batch["input_ids"].shape[0] == 2 * micro_batch_size  # two rows a pair
    assert seen and len(seen) == len(set(seen))  # no pair twice, within or across ranks
    if shuffle:
        assert len(seen) < 2 * PAIRS  # the incomplete last global batch is dropped...
        assert len(loaders[0]) == len(loaders[1])
    else:
        assert sorted(seen) == list(range(2 * PAIRS))  # ...and kept, filled, when every sample counts
        assert len(loaders[0]) == len(loaders[1])


def test_packed_rows_hold_each_pair_as_two_documents_of_the_same_row() -> None:
    loader = pair_loaders(packing=True, micro_batch_size=1)[0]
    samples = loader.samples
    for batch in loader:
        for row, members in enumerate(sequences_by_row(batch, packed=True)):
            documents = batch["document_ids"][row]
            for document, i in enumerate(members):
                tokens = samples.sample(i)[0]
                assert batch["input_ids"][row][documents == document].tolist() == tokens[:-1].tolist()
            assert int(batch["row_lengths"][row]) == sum(int(samples.lengths[i]) - 1 for i in members)


def test_unpacked_a_micro_batch_of_one_pair_is_its_two_rows() -> None:
    loader = pair_loaders(packing=False, micro_batch_size=1)[1]
    samples = loader.samples
    assert loader.positions.tolist() == (samples.lengths[0::2] + samples.lengths[1::2] - 2).tolist()
    batches = list(loader)
    assert batches
    for batch in batches:
        chosen, rejected = batch["sequence_samples"].tolist()
        assert chosen % 2 == 0 and rejected == chosen + 1
        assert batch["input_ids"].shape[0] == 2
        for row, i in enumerate((chosen, rejected)):
            tokens = samples.sample(i)[0][:-1].tolist()
            assert batch["input_ids"][row][: len(tokens)].tolist() == tokens
            assert int(batch["row_lengths"][row]) == len(tokens)
