"""Preference pairs in a `Samples` store: sample 2k is pair k's chosen sample (its prompt and preferred reply),
sample 2k + 1 its rejected one (the same prompt, the other reply), as `ChatFormat.pair_samples` tokenizes them.
A pair is one unit everywhere after tokenizing: held out for validation whole, truncated to fit one row whole
(both samples packed into the same row as two documents, or two rows of the same micro-batch), dealt to one
rank whole. Everything here works on the per-sample arrays; no token is copied or read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from litsft.data.samples import Samples


def pair_positions(samples: Samples) -> np.ndarray:
    """The positions each pair fills in a row: both samples' tokens but one each."""
    return (samples.lengths[0::2] - 1) + (samples.lengths[1::2] - 1)


def pair_samples(pairs: np.ndarray) -> np.ndarray:
    """The sample indices of pair indices (or of a boolean mask over pairs): 2k and 2k + 1 for each."""
    pairs = np.flatnonzero(pairs) if pairs.dtype == bool else np.asarray(pairs)
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


@dataclass
class PairTruncation:
    """What `truncate_pairs` cut."""

    pairs: int = 0
    truncated: int = 0
    """Pairs longer than a row, cut to fit it."""
    prompt_tokens: int = 0
    """Tokens cut from the start of truncated pairs' prompts (counted once per pair)."""
    reply_tokens: int = 0
    """Tokens cut from the ends of their replies (both replies' summed)."""
    dropped: int = 0
    """Pairs left without a reply token in one of their samples, dropped."""

    def notice(self, max_seq_length: int) -> str | None:
        """One line for the run's log; None when nothing was cut."""
        if not self.truncated:
            return None
        line = (
            f"Truncated {self.truncated} of {self.pairs} preference pairs to fit both replies in "
            f"max_seq_length={max_seq_length}: {self.prompt_tokens} tokens cut from the starts of their "
            f"prompts (their ends kept), {self.reply_tokens} from the ends of their replies"
        )
        if self.dropped:
            line += f"; {self.dropped} pairs left without a reply token dropped"
        return line + "; raise --train.max_seq_length to train on them whole"


def truncate_pairs(samples: Samples, max_positions: int) -> tuple[Samples, PairTruncation]:
    """Cut each pair whose two samples fill more than `max_positions` positions together: first the start of
    the prompt (both samples the same tokens; at least one prompt token is kept, so that the reply's first
    token is still predicted), then, if that is not enough, the ends of the replies (the longer first, each
    kept to at least half a row where it can). Pairs left without a reply token in a sample are dropped. A
    view: no token is copied."""
    lengths = samples.lengths.astype(np.int64)
    firsts = samples.first_targets.astype(np.int64)
    chosen, rejected = lengths[0::2] - 1, lengths[1::2] - 1
    excess = np.maximum(chosen + rejected - max_positions, 0)
    prompt = np.minimum(firsts[0::2], firsts[1::2])
    cut = np.minimum(-(-excess // 2), np.maximum(prompt - 1, 0))
    chosen, rejected = chosen - cut, rejected - cut
    half = max_positions // 2
    kept_chosen = np.minimum(chosen, np.maximum(half, max_positions - rejected))
    kept_rejected = np.minimum(rejected, max_positions - kept_chosen)
    report = PairTruncation(
        pairs=len(chosen),
        truncated=int((excess > 0).sum()),
        prompt_tokens=int(cut.sum()),
        reply_tokens=int((chosen - kept_chosen).sum() + (rejected - kept_rejected).sum()),
    )
    dtype = samples.lengths.dtype
    per_sample_cut = np.repeat(cut, 2)
    new_lengths = np.stack([kept_chosen, kept_rejected], axis=1).reshape(-1) + 1
    new_firsts = np.minimum(firsts - per_sample_cut, new_lengths)
    truncated = Samples(
        samples.tokens,
        samples.targets,
        (samples.starts + per_sample_cut).astype(dtype),
        new_lengths.astype(dtype),
        new_firsts.astype(dtype),
    )
    has_target = new_firsts < new_lengths
    keep = has_target[0::2] & has_target[1::2]
    report.dropped = int((~keep).sum())
    if report.dropped:
        truncated = truncated.subset(pair_samples(keep))
    return truncated, report
