"""Corpus BLEU and chrF by sacreBLEU: the one place the project computes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class CorpusScores(NamedTuple):
    bleu: float  # sacreBLEU corpus BLEU, 0..100
    chrf: float  # chrF, 0..100
    signature: str  # sacreBLEU's signature of the BLEU computation (tokenizer, smoothing, ...)
    report: str  # two lines: each score formatted by sacreBLEU with its signature


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> CorpusScores:
    """BLEU, chrF and their signatures for detokenized hypotheses, one reference each."""
    from sacrebleu.metrics import BLEU, CHRF

    hyps, refs = list(hypotheses), [list(references)]
    bleu, chrf = BLEU(), CHRF()
    bleu_score, chrf_score = bleu.corpus_score(hyps, refs), chrf.corpus_score(hyps, refs)
    signature = str(bleu.get_signature())
    report = "\n".join(
        (
            bleu_score.format(signature=signature),
            chrf_score.format(signature=str(chrf.get_signature())),
        )
    )
    return CorpusScores(bleu_score.score, chrf_score.score, signature, report)
