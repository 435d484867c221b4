"""Skipped and repeated words: the failure modes of attention on monotonic tasks.

On a task whose output follows its input left to right (speech recognition of spoken words,
for one), a decoder whose cross-attention jumps ahead drops words, and one whose attention
stays put says a word again. Both show in a minimum-edit word alignment of an output to
its reference:

  skipped   a reference word the alignment deletes (the output lacks it);
  repeated  an inserted output word equal to its neighbour in the output
            ("two two hundred" for "two hundred").

Substitutions are counted too, so the counts also give the word error rate
(substitutions + deletions + insertions) / reference words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class AlignmentCounts:
    """Edit operations of one or many outputs against their references."""

    reference_words: int = 0
    substituted: int = 0
    skipped: int = 0  # deletions
    inserted: int = 0  # insertions, repeated ones included
    repeated: int = 0  # insertions equal to a neighbouring output word
    outputs: int = 0
    outputs_skipping: int = 0  # outputs with at least one skipped word
    outputs_repeating: int = 0  # outputs with at least one repeated word
    outputs_either: int = 0  # outputs with a skipped or a repeated word

    def __add__(self, other: AlignmentCounts) -> AlignmentCounts:
        return AlignmentCounts(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )

    @property
    def word_error_rate(self) -> float:
        errors = self.substituted + self.skipped + self.inserted
        return errors / max(self.reference_words, 1)

    def summary(self) -> dict[str, float]:
        n = max(self.outputs, 1)
        return {
            "wer": self.word_error_rate,
            "skip_share": self.outputs_skipping / n,
            "repeat_share": self.outputs_repeating / n,
            "skip_or_repeat_share": self.outputs_either / n,
        }


def align(output: Sequence[str], reference: Sequence[str]) -> list[tuple[str, int, int]]:
    """A minimum-edit alignment of two word lists, as operations in order.

    Each operation is (kind, output index, reference index) with kind "match", "sub",
    "del" (reference word missing: output index -1) or "ins" (extra output word: reference
    index -1). Ties prefer match/sub, then deletion, then insertion.
    """
    n, m = len(output), len(reference)
    cost = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        cost[i][0] = i
    for j in range(m + 1):
        cost[0][j] = j
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            diagonal = cost[i - 1][j - 1] + (output[i - 1] != reference[j - 1])
            cost[i][j] = min(diagonal, cost[i][j - 1] + 1, cost[i - 1][j] + 1)
    ops = []
    i, j = n, m
    while i or j:
        if i and j and cost[i][j] == cost[i - 1][j - 1] + (output[i - 1] != reference[j - 1]):
            ops.append(("match" if output[i - 1] == reference[j - 1] else "sub", i - 1, j - 1))
            i, j = i - 1, j - 1
        elif j and cost[i][j] == cost[i][j - 1] + 1:
            ops.append(("del", -1, j - 1))
            j -= 1
        else:
            ops.append(("ins", i - 1, -1))
            i -= 1
    return ops[::-1]


def alignment_counts(output: str, reference: str) -> AlignmentCounts:
    """The edit operations of one output against its reference (words split on spaces)."""
    out, ref = output.split(), reference.split()
    counts = {"match": 0, "sub": 0, "del": 0, "ins": 0}
    repeated = 0
    for kind, i, _ in align(out, ref):
        counts[kind] += 1
        if kind == "ins" and out[i] in out[max(i - 1, 0) : i] + out[i + 1 : i + 2]:
            repeated += 1
    skips, repeats = counts["del"] > 0, repeated > 0
    return AlignmentCounts(
        reference_words=len(ref),
        substituted=counts["sub"],
        skipped=counts["del"],
        inserted=counts["ins"],
        repeated=repeated,
        outputs=1,
        outputs_skipping=int(skips),
        outputs_repeating=int(repeats),
        outputs_either=int(skips or repeats),
    )


def corpus_counts(outputs: Sequence[str], references: Sequence[str]) -> AlignmentCounts:
    """`alignment_counts` summed over pairs (one output per reference)."""
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs for {len(references)} references")
    total = AlignmentCounts()
    for output, reference in zip(outputs, references):
        total = total + alignment_counts(output, reference)
    return total
