"""litsft/training/objectives/preference.py: what every preference objective shares, on a tiny Transformer and
batches built the way training builds them (pair samples -> collate(sequences=True) -> model_inputs): each
sequence's reply log-probability, the same packed as unpacked (loss and gradients), filler rows left out of the
loss, the units and the logged statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_pairs import tiny_llama

from litsft.data.chat import ChatFormat
from litsft.data.loader import IGNORE_INDEX, Row, collate
from litsft.data.records import to_conversation
from litsft.data.samples import Samples
from litsft.data.tokenizer import Tokenizer
from litsft.model.network.batch import model_inputs
from litsft.model.network.transformer import Transformer
from litsft.training.objectives import objective_named
from litsft.training.objectives.dpo import DPO
from litsft.training.objectives.orpo import ORPO
from litsft.training.objectives.preference import sequence_logps
from litsft.training.objectives.simpo import SimPO

RECORDS = [
    {
        "prompt": "What is the red cat?",
        "chosen": "A small dog.",
        "rejected": "The blue river runs far today.",
    },
    {"prompt": "Count to three, please.", "chosen": "One two three.", "rejected": "No."},
    {"prompt": "Hello?", "chosen": "Hello world, how are you?", "rejected": "Why should I answer that?"},
]
PACKED_ROWS: list[Row] = [[0, 1, 2, 3], [4, 5]]
UNPACKED_ROWS: list[Row] = [[i] for i in range(6)]
BETA = 0.1


@pytest.fixture(scope="module")
def samples(tokenizer: Tokenizer) -> Samples:
    tokens, targets, lengths, report = ChatFormat(tokenizer, pairs=True).tokenize_many(
        [to_conversation(record) for record in RECORDS]
    )
    assert len(lengths) == 6 and not report.skipped
    return Samples.back_to_back(tokens, targets, lengths)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_llama()


def reference_values(samples: Samples) -> np.ndarray:
    """Reference log-probabilities near what an untrained model gives (about -6.2 a token), so that DPO's
    log-ratios are of order one."""
    rng = np.random.default_rng(1)
    targets = np.array([samples.sample(i)[1][1:].sum() for i in range(len(samples))])
    return -(6.2 + 0.2 * rng.normal(size=len(samples))) * targets


def inputs_of(samples: Samples, rows: list[Row], packed: bool) -> dict:
    width = int(max(samples.lengths)) * 4 if packed else None
    batch = collate(
        samples, rows, width, 0, sequences=True, per_sample={"reference_logps": reference_values(samples)}
    )
    return model_inputs(batch)


def by_hand_logps(model: Transformer, samples: Samples, indices: list[int]) -> torch.Tensor:
    """Each sample's summed log-probability of its targets, from the logits of the sample alone (float64)."""
    logps = []
    with torch.no_grad():
        for i in indices:
            tokens, targets = (torch.from_numpy(np.array(a)) for a in samples.sample(i))
            log_probs = torch.log_softmax(model(tokens[None, :-1].long())[0].double(), dim=-1)
            picked = log_probs.gather(1, tokens[1:].long()[:, None])[:, 0]
            logps.append(picked[targets[1:]].sum())
    return torch.stack(logps)


def test_sequence_logps_are_each_sequences_summed_target_log_probabilities(
    model: Transformer, samples: Samples
) -> None:
    unpacked = inputs_of(samples, UNPACKED_ROWS, packed=False)
    with torch.no_grad():
        logps = sequence_logps(model, unpacked)
        # From the padded batch's logits, row by row: log_softmax gathered at each row's labels.
        log_probs = torch.log_softmax(model(unpacked["input_ids"]).double(), dim=-1)
    labels = unpacked["labels"]
    rows = [log_probs[b][labels[b] != IGNORE_INDEX].gather(1, labels[b][labels[b] != IGNORE_INDEX][:, None]).sum()
            for b in range(len(labels))]  # fmt: skip
    assert logps.shape == (6,) and logps.dtype == torch.float32
    torch.testing.assert_close(logps.double(), torch.stack(rows), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        logps.double(), by_hand_logps(model, samples, list(range(6))), rtol=1e-5, atol=1e-4
    )
    # Packed, the documents come in the same order: chosen, rejected, chosen, rejected...
    packed = inputs_of(samples, PACKED_ROWS, packed=True)
    assert packed["sequence_samples"].tolist() == list(range(6))
    with torch.no_grad():
        torch.testing.assert_close(sequence_logps(model, packed), logps, rtol=1e-5, atol=1e-5)
    assert packed["sequence_targets"].tolist() == [int(samples.sample(i)[1][1:].sum()) for i in range(6)]


@pytest.mark.parametrize(
    "objective",
    [DPO(BETA), DPO(0.5, label_smoothing=0.2), SimPO(), ORPO()],
    ids=["dpo", "dpo-smoothed", "simpo", "orpo"],
)
def test_a_packed_batch_gives_the_loss_and_gradients_of_the_unpacked_batch_of_the_same_pairs(
    model: Transformer, samples: Samples, objective
) -> None:
    results = []
    for rows, packed in ((PACKED_ROWS, True), (UNPACKED_ROWS, False)):
        inputs = inputs_of(samples, rows, packed)
        assert objective.units(inputs) == 3
        model.zero_grad(set_to_none=True)
        loss = objective.summed_loss(model, inputs)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((loss.detach(), grads, objective.take_sums()))
    model.zero_grad(set_to_none=True)
    (packed_loss, packed_grads, packed_sums), (loss, grads, sums) = results
    assert loss.item() > 0 and torch.isfinite(loss)
    assert packed_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    for name, grad in grads.items():
        assert grad.abs().max() > 0 or "bias" in name, name
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(packed_sums, sums, rtol=1e-5, atol=1e-5)


def test_dpos_summed_loss_and_statistics_are_over_the_real_pairs(
    model: Transformer, samples: Samples
) -> None:
    """Two real pairs and a filler pair of empty rows (sample -1, what fills an ordered pass's last batch): the loss
    is the sum over the two pairs of the DPO formula, the units are 2, take_sums the 4 statistics summed over them."""
    with torch.no_grad():
        logps = by_hand_logps(model, samples, [0, 1, 2, 3])
    reference = torch.from_numpy(reference_values(samples)[:4])
    h = (logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2])
    expected_loss = -torch.nn.functional.logsigmoid(BETA * h).sum()
    chosen, rejected = BETA * (logps[0::2] - reference[0::2]), BETA * (logps[1::2] - reference[1::2])
    expected_sums = torch.stack(
        [chosen.sum(), rejected.sum(), (chosen > rejected).double().sum(), (chosen - rejected).sum()]
    )
    objective = DPO(BETA)
    assert objective.take_sums() is None
    for rows, packed in (([[0], [1], [2], [3], [], []], False), ([[0, 1], [2, 3], []], True)):
        inputs = inputs_of(samples, rows, packed)
        assert inputs["sequence_samples"].tolist() == ([0, 1, 2, 3, -1, -1] if not packed else [0, 1, 2, 3])
        assert objective.units(inputs) == 2
        with torch.no_grad():
            loss = objective.summed_loss(model, inputs)
        assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5, abs=1e-5)
        sums = objective.take_sums()
        assert sums.shape == (4,)
        torch.testing.assert_close(sums.double(), expected_sums, rtol=1e-4, atol=1e-5)
        assert objective.take_sums() is None  # taken: the next micro-batch starts from nothing
    # Two micro-batches before a take: their sums add up.
    with torch.no_grad():
        for _ in range(2):
            objective.summed_loss(model, inputs_of(samples, [[0, 1], [2, 3]], packed=True))
    torch.testing.assert_close(objective.take_sums().double(), 2 * expected_sums, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "dpo",
        "ipo",
        "simpo",
        "orpo",
    ],
)
def test_a_filler_pair_adds_nothing_to_any_objectives_loss(
    model: Transformer, samples: Samples, name: str
) -> None:
    """An unpacked ordered pass (validation, the reference's) ends with a pair of empty rows: every objective's
    loss and statistics are those of the real pairs alone."""
    objective = objective_named(name)
    with torch.no_grad():
        alone = objective.summed_loss(model, inputs_of(samples, [[0], [1], [2], [3]], packed=False))
        sums = objective.take_sums()
        filled = objective.summed_loss(model, inputs_of(samples, [[0], [1], [2], [3], [], []], packed=False))
    torch.testing.assert_close(objective.take_sums(), sums)
    assert torch.isfinite(filled) and filled.item() == pytest.approx(alone.item(), rel=1e-6)


def test_a_pair_whose_chosen_reply_gained_more_counts_as_accurate(
    model: Transformer, samples: Samples
) -> None:
    """The reference a known distance below the model's own log-probabilities: the rewards are beta x those
    distances, and a pair is accurate where its chosen reply's reward is the higher."""
    with torch.no_grad():
        logps = by_hand_logps(model, samples, list(range(6))).numpy()
    gains = np.array([0.0, 2.0, 3.0, 0.0, 0.5, 1.0])  # pair 1 alone favours its chosen reply
    inputs = model_inputs(
        collate(
            samples, UNPACKED_ROWS, None, 0, sequences=True, per_sample={"reference_logps": logps - gains}
        )
    )
    objective = DPO(BETA)
    with torch.no_grad():
        objective.summed_loss(model, inputs)
    chosen, rejected, accuracy, margin = objective.take_sums().tolist()
    assert chosen == pytest.approx(BETA * 3.5, abs=1e-4)
    assert rejected == pytest.approx(BETA * 3.0, abs=1e-4)
    assert accuracy == 1.0
    assert margin == pytest.approx(BETA * 0.5, abs=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_packed_micro_batch_of_filler_rows_scores_no_sequence(
    model: Transformer, samples: Samples, rows: int
) -> None:
    inputs = inputs_of(samples, [[] for _ in range(rows)], packed=True)
    assert inputs["sequence_samples"].tolist() == [] and inputs["pairs"] == 0
    objective = DPO(BETA)
    with torch.no_grad():
        assert sequence_logps(model, inputs).shape == inputs["sequence_samples"].shape
        assert objective.summed_loss(model, inputs).item() == 0.0
    assert objective.units(inputs) == 0
