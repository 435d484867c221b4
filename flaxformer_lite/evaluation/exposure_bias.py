"""Exposure-bias figures from arrays: teacher forcing (TF) vs free running (FR).

Training feeds the decoder the gold prefix; decoding feeds it its own output,
so one early error can derail the rest. These functions put numbers on that
from the arrays of one held-out set (N examples, T target and L output
positions), all plain numpy:

  gold       int[N, T]  reference ids ending in EOS, PAD_ID after it
  forced     int[N, T]  `Seq2SeqModel.forced_argmax`: the argmax at every
                        position given the gold prefix (PAD_ID at padding)
  greedy     int[N, L]  greedy output ids ending in EOS (unless cut at L),
                        PAD_ID after it
  gold_nll   float[N, K] summed NLL of the gold suffix gold[k:] (EOS included)
                        after the gold prefix gold[:k], for each k of `ks`
  own_nll    float[N, K] the same suffix after the model's greedy prefix
                        greedy[:k] (the sequence greedy[:k] + gold[k:] scored)

The figures (see `Report` and docs/methods.md, "Exposure bias report"):

  - token accuracy: TF = forced == gold over the gold tokens (EOS included);
    FR = the greedy prefix that equals the gold sequence, summed over the
    examples and divided by the summed gold lengths; the gap is TF - FR.
  - first error: the first position where greedy output and gold differ
    (comparing through EOS; exact matches have none), as counts per position
    and their mean.
  - prefix swap (He et al. 2021, "Exposure Bias versus Self-Recovery"): the
    gold suffix's NLL after the model's own prefix over its NLL after the gold
    prefix; > 1 means the model's own prefixes hurt it.
  - by gold length bucket: exact match, TF (every forced argmax right) vs FR
    (greedy output == gold), and the two token accuracies. With greedy
    decoding the two exact matches agree (greedy output is gold exactly when
    every forced argmax is), up to near-ties that cached decoding and the full
    forward pass round differently; the token accuracies show where the
    errors accumulate.

Comparisons are position by position, so an insertion or a deletion counts as
an error at every later position (Arora et al. 2022 use an oracle model for
that reason); the first-error figures do not depend on it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flaxformer_lite.constants import EOS_ID, PAD_ID

KS = (1, 2, 4, 8)  # prefix lengths of the prefix-swap test
# Gold lengths (tokens incl. EOS) of the exact-match buckets: (low, high), None = no limit.
LENGTH_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None))


def pad_to(tokens: np.ndarray, width: int) -> np.ndarray:
    """int[N, W] -> int[N, max(W, width)], PAD_ID on the right."""
    extra = width - tokens.shape[1]
    if extra <= 0:
        return tokens
    return np.pad(tokens, ((0, 0), (0, extra)), constant_values=PAD_ID)


def sequence_lengths(tokens: np.ndarray) -> np.ndarray:
    """Tokens up to and including the first EOS (all non-PAD ones when there is none).

    Args:
      tokens: int[N, L].
    Returns:
      int[N].
    """
    tokens = np.asarray(tokens)
    is_eos = tokens == EOS_ID
    has_eos = is_eos.any(axis=1)
    return np.where(has_eos, is_eos.argmax(axis=1) + 1, (tokens != PAD_ID).sum(axis=1))


def tokens_before_eos(tokens: np.ndarray) -> np.ndarray:
    """int[N]: the tokens of int[N, L] before the first EOS (all non-PAD ones without EOS)."""
    tokens = np.asarray(tokens)
    return sequence_lengths(tokens) - (tokens == EOS_ID).any(axis=1)


def matched_prefix(gold: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """int[N]: how many leading tokens of the greedy output equal the gold sequence.

    Compared through the gold EOS, so an exact match gives the gold length.

    Args:
      gold: int[N, T]; greedy: int[N, L].
    """
    gold, greedy = np.asarray(gold), np.asarray(greedy)
    width = max(gold.shape[1], greedy.shape[1])
    g, h = pad_to(gold, width), pad_to(greedy, width)
    lengths = sequence_lengths(gold)
    differ = (g != h) & (np.arange(width) < lengths[:, None])  # [N, W]
    return np.where(differ.any(axis=1), differ.argmax(axis=1), lengths)


def first_errors(gold: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """int[N]: the first position where greedy output and gold differ, -1 for exact matches."""
    matched = matched_prefix(gold, greedy)
    return np.where(matched < sequence_lengths(gold), matched, -1)


def tf_token_accuracy(gold: np.ndarray, forced: np.ndarray) -> float:
    """Fraction of the gold tokens (EOS included) that the teacher-forced argmax gets right."""
    gold, forced = np.asarray(gold), np.asarray(forced)
    real = np.arange(gold.shape[1]) < sequence_lengths(gold)[:, None]  # [N, T]
    return _ratio(((forced == gold) & real).sum(), real.sum())


def fr_token_accuracy(gold: np.ndarray, greedy: np.ndarray) -> float:
    """Summed greedy prefixes that equal the gold sequence over the summed gold lengths."""
    return _ratio(matched_prefix(gold, greedy).sum(), sequence_lengths(gold).sum())


def first_error_histogram(gold: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """int[T]: examples whose first error is at position 0, 1, ..., T - 1."""
    errors = first_errors(gold, greedy)
    return np.bincount(errors[errors >= 0], minlength=np.asarray(gold).shape[1])


def _ratio(num, den) -> float:
    return float(num) / float(den) if den else math.nan


@dataclasses.dataclass(frozen=True)
class PrefixSwap:
    """The prefix-swap test at one prefix length k.

    Over the `n` eligible examples (gold longer than k tokens, greedy output
    with at least k tokens before its EOS): the mean summed NLL (nats) of the
    gold suffix gold[k:] after the gold prefix and after the greedy prefix.
    """

    k: int
    n: int
    gold_nll: float
    own_nll: float
    differ: float  # fraction of the n whose greedy prefix differs from the gold one

    @property
    def ratio(self) -> float:
        """own_nll / gold_nll: > 1 when the model's own prefixes hurt it."""
        return _ratio(self.own_nll, self.gold_nll) if self.gold_nll > 0 else math.nan


def prefix_swap(
    gold: np.ndarray, greedy: np.ndarray, gold_nll: np.ndarray, own_nll: np.ndarray, k: int
) -> PrefixSwap:
    """The prefix-swap figures at prefix length k.

    Args:
      gold: int[N, T]; greedy: int[N, L].
      gold_nll, own_nll: float[N], the summed suffix NLLs at this k (module docstring).
    """
    gold, greedy = np.asarray(gold), np.asarray(greedy)
    eligible = (sequence_lengths(gold) > k) & (tokens_before_eos(greedy) >= k)  # [N]
    width = max(gold.shape[1], greedy.shape[1], k)
    differ = (pad_to(greedy, width)[:, :k] != pad_to(gold, width)[:, :k]).any(axis=1)
    n = int(eligible.sum())
    return PrefixSwap(
        k=k,
        n=n,
        gold_nll=_ratio(np.asarray(gold_nll)[eligible].sum(), n),
        own_nll=_ratio(np.asarray(own_nll)[eligible].sum(), n),
        differ=_ratio(differ[eligible].sum(), n),
    )


@dataclasses.dataclass(frozen=True)
class LengthBucket:
    """Exact match of the examples whose gold length (tokens incl. EOS) is in [low, high]."""

    low: int
    high: int | None  # None: no upper limit
    count: int
    tf_exact: float  # fraction with every teacher-forced argmax right
    fr_exact: float  # fraction whose greedy output equals the gold sequence
    tf_accuracy: float  # teacher-forced token accuracy of these examples
    fr_accuracy: float  # free-running token accuracy (matched prefixes) of these examples

    @property
    def label(self) -> str:
        """ "9-16", or "65+" for the open bucket."""
        return f"{self.low}+" if self.high is None else f"{self.low}-{self.high}"

    @property
    def key(self) -> str:
        """The label as a metric-name part: "9-16", "65up"."""
        return f"{self.low}up" if self.high is None else self.label


def length_buckets(
    gold: np.ndarray,
    forced: np.ndarray,
    greedy: np.ndarray,
    buckets: tuple[tuple[int, int | None], ...] = LENGTH_BUCKETS,
) -> tuple[LengthBucket, ...]:
    """TF and FR exact match and token accuracy per gold-length bucket; empty ones left out.

    Args:
      gold, forced: int[N, T]; greedy: int[N, L].
    """
    gold, forced = np.asarray(gold), np.asarray(forced)
    lengths = sequence_lengths(gold)
    real = np.arange(gold.shape[1]) < lengths[:, None]
    tf_hits = ((forced == gold) & real).sum(axis=1)  # [N]
    matched = matched_prefix(gold, greedy)  # [N]
    out = []
    for low, high in buckets:
        inside = (lengths >= low) & (lengths <= (high if high is not None else np.inf))
        count = int(inside.sum())
        if count:
            out.append(
                LengthBucket(
                    low,
                    high,
                    count,
                    tf_exact=float((tf_hits == lengths)[inside].mean()),
                    fr_exact=float((matched == lengths)[inside].mean()),
                    tf_accuracy=_ratio(tf_hits[inside].sum(), lengths[inside].sum()),
                    fr_accuracy=_ratio(matched[inside].sum(), lengths[inside].sum()),
                )
            )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Report:
    """Every exposure-bias figure of one held-out set (see the module docstring)."""

    examples: int
    tf_token_accuracy: float
    fr_token_accuracy: float
    first_error_histogram: tuple[int, ...]  # examples per first-error position 0..T-1
    prefix_swaps: tuple[PrefixSwap, ...]
    length_buckets: tuple[LengthBucket, ...]

    @property
    def accuracy_gap(self) -> float:
        return self.tf_token_accuracy - self.fr_token_accuracy

    @property
    def first_error_mean(self) -> float:
        """Mean first-error position over the examples with an error (NaN: none)."""
        counts = np.asarray(self.first_error_histogram)
        return _ratio((counts * np.arange(counts.size)).sum(), counts.sum())

    def metrics(self) -> dict[str, float]:
        """Flat scalar names for metrics.jsonl and TensorBoard (docs/methods.md lists them)."""
        out = {
            "eb_tf_token_accuracy": self.tf_token_accuracy,
            "eb_fr_token_accuracy": self.fr_token_accuracy,
            "eb_accuracy_gap": self.accuracy_gap,
            "eb_first_error_mean": self.first_error_mean,
        }
        for s in self.prefix_swaps:
            out[f"eb_prefix_nll_gold_k{s.k}"] = s.gold_nll
            out[f"eb_prefix_nll_own_k{s.k}"] = s.own_nll
            out[f"eb_prefix_ratio_k{s.k}"] = s.ratio
            out[f"eb_prefix_n_k{s.k}"] = float(s.n)
            out[f"eb_prefix_differ_k{s.k}"] = s.differ
        for b in self.length_buckets:
            out[f"eb_tf_exact_len{b.key}"] = b.tf_exact
            out[f"eb_fr_exact_len{b.key}"] = b.fr_exact
            out[f"eb_tf_accuracy_len{b.key}"] = b.tf_accuracy
            out[f"eb_fr_accuracy_len{b.key}"] = b.fr_accuracy
            out[f"eb_count_len{b.key}"] = float(b.count)
        return out

    def histograms(self) -> dict[str, list[int]]:
        """{"eb_first_error_hist": counts per position}: a list-valued metric."""
        return {"eb_first_error_hist": list(self.first_error_histogram)}

    def table(self) -> str:
        """The report as aligned lines for a terminal."""
        errors = sum(self.first_error_histogram)
        shown = " ".join(f"{t}:{c}" for t, c in enumerate(self.first_error_histogram) if c)
        lines = [
            f"exposure bias over {self.examples} example(s), greedy decoding vs the references",
            f"token accuracy  teacher-forced {self.tf_token_accuracy:.4f}  "
            f"free-running {self.fr_token_accuracy:.4f}  gap {self.accuracy_gap:+.4f}",
            f"first error     mean position {self.first_error_mean:.2f} over {errors} "
            f"example(s) with an error; position:count {shown or '-'}",
            "prefix swap     k  gold NLL   own NLL   ratio      n  differ",
        ]
        for s in self.prefix_swaps:
            lines.append(
                f"                {s.k:<2} {s.gold_nll:8.4f}  {s.own_nll:8.4f}  {s.ratio:6.3f}"
                f"  {s.n:5d}  {s.differ:6.3f}"
            )
        lines.append("by length       length      n  exact TF  exact FR  tokens TF  tokens FR")
        for b in self.length_buckets:
            lines.append(
                f"                {b.label:<9} {b.count:4d}  {b.tf_exact:8.3f}  {b.fr_exact:8.3f}"
                f"  {b.tf_accuracy:9.3f}  {b.fr_accuracy:9.3f}"
            )
        return "\n".join(lines)


def compute_report(
    gold: np.ndarray,
    forced: np.ndarray,
    greedy: np.ndarray,
    gold_nll: np.ndarray,
    own_nll: np.ndarray,
    ks: tuple[int, ...] = KS,
    own: np.ndarray | None = None,
) -> Report:
    """Every figure of one held-out set.

    Args:
      gold, forced: int[N, T]; greedy: int[N, L]; gold_nll, own_nll: float[N, len(ks)]
      (module docstring).
      own: int[N, L] the greedy output the prefix swap scored, when `greedy` is
        that output re-tokenized like `gold` (default: `greedy`).
    """
    own = greedy if own is None else own
    gold_nll, own_nll = np.asarray(gold_nll), np.asarray(own_nll)
    return Report(
        examples=int(np.asarray(gold).shape[0]),
        tf_token_accuracy=tf_token_accuracy(gold, forced),
        fr_token_accuracy=fr_token_accuracy(gold, greedy),
        first_error_histogram=tuple(int(c) for c in first_error_histogram(gold, greedy)),
        prefix_swaps=tuple(
            prefix_swap(gold, own, gold_nll[:, i], own_nll[:, i], k) for i, k in enumerate(ks)
        ),
        length_buckets=length_buckets(gold, forced, greedy),
    )
