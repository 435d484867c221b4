"""Symptoms of multi-modality in decoded output, measured against references.

A non-autoregressive decoder predicts every position independently given the
source, so where the data allow several translations it can mix them: the
same token twice in a row ("the the") where two modes put it at neighbouring
positions, and lengths that fit neither (Gu et al. 2018). Two shares of the
outputs make that visible for any decoder, autoregressive ones included:

  repeated      outputs with a target token (a vocabulary piece) repeated back
                to back; the references' own share is the baseline.
  wrong_length  outputs whose number of pieces differs from the reference's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def has_repeat(ids: Sequence[int]) -> bool:
    """Whether some token follows itself."""
    return any(a == b for a, b in zip(ids, ids[1:]))


class Multimodality(NamedTuple):
    outputs: int  # pairs measured (empty sources left out)
    repeated: float  # share of outputs with a back-to-back repeat
    reference_repeated: float  # the same share of the references
    wrong_length: float  # share of outputs with another length than the reference
    mean_length_difference: float  # mean (output - reference) pieces

    def line(self) -> str:
        return (
            f"multi-modality: {self.repeated:.1%} of {self.outputs} outputs repeat a token back "
            f"to back (references: {self.reference_repeated:.1%}); {self.wrong_length:.1%} "
            f"differ from the reference's length (mean difference "
            f"{self.mean_length_difference:+.2f} tokens)"
        )


def measure(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> Multimodality:
    """The shares over pairs of output and reference token ids (EOS and padding left out).

    Raises:
      ValueError: the counts differ.
    """
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs but {len(references)} references")
    n = max(len(outputs), 1)
    return Multimodality(
        outputs=len(outputs),
        repeated=sum(map(has_repeat, outputs)) / n,
        reference_repeated=sum(map(has_repeat, references)) / n,
        wrong_length=sum(len(o) != len(r) for o, r in zip(outputs, references)) / n,
        mean_length_difference=sum(len(o) - len(r) for o, r in zip(outputs, references)) / n,
    )
