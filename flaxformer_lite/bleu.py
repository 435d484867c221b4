"""Corpus BLEU and chrF by sacreBLEU: the one place the project computes them.

`corpus_scores` is the primary figure: sacreBLEU on detokenized text, with its
signature. `tokenized_bleu` is the figure Multi30k papers publish (fairseq's BLEU4 on
lowercased, punctuation-normalized, Moses-tokenized text), for comparing with them.
"""

from __future__ import annotations

import functools
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


class TokenizedBleu(NamedTuple):
    score: float  # corpus BLEU4, 0..100
    precisions: tuple[float, float, float, float]  # clipped 1- to 4-gram precisions, 0..100
    bp: float  # brevity penalty
    sys_len: int  # hypothesis tokens, after tokenization
    ref_len: int  # reference tokens, after tokenization
    description: str  # the preprocessing, e.g. "BLEU4 on lowercased Moses-tokenized text (...)"

    def format(self) -> str:
        """fairseq's line, as papers quote it: "BLEU4 = 41.02, 71.0/47.5/34.3/24.5 (BP=0.999,
        ratio=0.999, syslen=12096, reflen=12103)"."""
        precisions = "/".join(f"{p:.1f}" for p in self.precisions)
        ratio = self.sys_len / max(self.ref_len, 1)
        return (
            f"BLEU4 = {self.score:.2f}, {precisions} (BP={self.bp:.3f}, ratio={ratio:.3f}, "
            f"syslen={self.sys_len}, reflen={self.ref_len})"
        )


@functools.cache
def _moses(lang: str):
    """(punctuation normalizer, tokenizer) of `lang`, built once: each loads its rule files."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang), MosesTokenizer(lang)


def moses_tokenize(lines: Sequence[str], lang: str, *, lowercase: bool = True) -> list[str]:
    """Each line lowercased (optional), punctuation-normalized and Moses-tokenized, tokens
    joined by spaces; the characters special to Moses (& | < > ' " [ ]) are escaped, as
    Moses's tokenizer.perl does by default ("'" becomes "&apos;")."""
    normalizer, tokenizer = _moses(lang)
    return [
        tokenizer.tokenize(
            normalizer.normalize(line.lower() if lowercase else line),
            aggressive_dash_splits=False,
            escape=True,
            return_str=True,
        )
        for line in lines
    ]


def tokenized_bleu(
    hypotheses: Sequence[str], references: Sequence[str], lang: str, *, lowercase: bool = True
) -> TokenizedBleu:
    """Corpus BLEU4 after the same Moses preprocessing of both sides, one reference each.

    The preprocessing is `moses_tokenize`'s; the tokens are then scored by sacreBLEU with
    no tokenizer of its own and its default smoothing ('exp', which changes nothing unless
    an n-gram order has no match). On Multi30k's test_2016_flickr.de it reproduces the
    reference length fairseq reports (12103 tokens), so the score compares with published
    figures; it is not comparable with `corpus_scores`'s BLEU.

    Args:
      hypotheses, references: detokenized text, one line each, in the same order.
      lang: the target language's ISO code ("de", "en", "fr"), which picks Moses's rules.
      lowercase: lowercase both sides first (as the published figures do).
    """
    from importlib.metadata import version

    from sacrebleu.metrics import BLEU

    hyps = moses_tokenize(hypotheses, lang, lowercase=lowercase)
    refs = moses_tokenize(references, lang, lowercase=lowercase)
    # force: the input is tokenized on purpose (sacreBLEU warns about tokenized input).
    score = BLEU(tokenize="none", force=True).corpus_score(hyps, [refs])
    case = "lowercased " if lowercase else ""
    description = (
        f"BLEU4 on {case}Moses-tokenized text (sacremoses {version('sacremoses')}, "
        f"lang {lang}, normalized punctuation)"
    )
    return TokenizedBleu(
        score.score,
        tuple(score.precisions),
        score.bp,
        score.sys_len,
        score.ref_len,
        description,
    )
