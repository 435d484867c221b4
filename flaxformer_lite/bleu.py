"""Corpus BLEU and chrF by sacreBLEU: the one place the project computes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class CorpusScores(NamedTuple):
    bleu: float  # sacreBLEU corpus BLEU, 0..100
    chrf: float  # chrF, 0..100
    signature: str  # sacreBLEU's signature of the BLEU computation (tokenizer, smoothing, ...)


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> CorpusScores:
    """BLEU, chrF and the BLEU signature of detokenized hypotheses against one reference each."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu = BLEU()
    score = bleu.corpus_score(list(hypotheses), [list(references)]).score
    chrf = CHRF().corpus_score(list(hypotheses), [list(references)]).score
    return CorpusScores(score, chrf, str(bleu.get_signature()))
