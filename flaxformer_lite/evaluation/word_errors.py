"""Word error rate: word-level Levenshtein distance over the reference's word count.

WER = (substitutions + deletions + insertions) / reference words, summed over a corpus before
dividing (as jiwer and sclite do), so long references weigh more. Words are split on
whitespace.
"""

from __future__ import annotations

from collections.abc import Sequence


def edit_distance(hypothesis: Sequence[str], reference: Sequence[str]) -> int:
    """The fewest substitutions, deletions and insertions that turn ``reference`` into
    ``hypothesis`` (one row of the dynamic programme kept, O(len(hyp)) memory)."""
    previous = list(range(len(hypothesis) + 1))  # distance of reference[:0] to hyp[:j]
    for i, ref_word in enumerate(reference, 1):
        current = [i]
        for j, hyp_word in enumerate(hypothesis, 1):
            current.append(
                min(
                    previous[j] + 1,  # reference word deleted
                    current[j - 1] + 1,  # hypothesis word inserted
                    previous[j - 1] + (ref_word != hyp_word),  # substituted or matched
                )
            )
        previous = current
    return previous[-1]


def word_error_rate(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus WER of ``hypotheses`` against ``references`` (same length; total word edits
    over total reference words; with no reference words at all: 0 if the hypotheses have none
    either, else 1)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    edits = words = 0
    for hyp, ref in zip(hypotheses, references):
        ref_words = ref.split()
        edits += edit_distance(hyp.split(), ref_words)
        words += len(ref_words)
    if words == 0:
        return float(edits > 0)
    return edits / words
