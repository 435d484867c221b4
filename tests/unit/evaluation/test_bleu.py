"""bleu.tokenized_bleu against hand-counted n-grams and a small BLEU4 written here, its
preprocessing of both sides, training's bleu_tok, and the reference length published for
Multi30k."""

import collections
import math
import pathlib

import numpy as np
import pytest

from flaxformer_lite.bleu import moses_tokenize, tokenized_bleu

ROOT = pathlib.Path(__file__).resolve().parents[3]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


def bleu4(hyps: list[list[str]], refs: list[list[str]]) -> tuple[float, list[float], float]:
    """Papineni et al.'s corpus BLEU4 (uniform weights, one reference each): 100 * BP *
    exp(mean_n log p_n), p_n the clipped n-gram matches over the hypothesis n-grams summed
    over the corpus, BP = exp(1 - r / c) when c < r. Returns (score, p_n in %, BP)."""
    matches, totals = [0] * 4, [0] * 4
    for hyp, ref in zip(hyps, refs):
        for n in range(1, 5):
            h = collections.Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
            r = collections.Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(count, r[gram]) for gram, count in h.items())
            totals[n - 1] += sum(h.values())
    c, r = sum(map(len, hyps)), sum(map(len, refs))
    bp = 1.0 if c >= r else math.exp(1 - r / c)
    log_p = [math.log(m / t) for m, t in zip(matches, totals)]  # every order has a match here
    return 100 * bp * math.exp(sum(log_p) / 4), [100 * m / t for m, t in zip(matches, totals)], bp


def test_hand_counted_sentence():
    # hyp: the cat sat on the mat / ref: the cat sat on a mat
    # 1-grams: the (2, clipped to 1), cat, sat, on, mat match: 5/6
    # 2-grams: the cat, cat sat, sat on match; on the, the mat do not: 3/5
    # 3-grams: the cat sat, cat sat on: 2/4; 4-grams: the cat sat on: 1/3; 6 tokens each: BP 1.
    out = tokenized_bleu(["the cat sat on the mat"], ["the cat sat on a mat"], "en")
    assert out.score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)  # 53.73
    assert out.precisions == pytest.approx((100 * 5 / 6, 100 * 3 / 5, 100 * 2 / 4, 100 / 3))
    assert (out.bp, out.sys_len, out.ref_len) == (1.0, 6, 6)
    assert out.format() == (
        "BLEU4 = 53.73, 83.3/60.0/50.0/33.3 (BP=1.000, ratio=1.000, syslen=6, reflen=6)"
    )


def test_corpus_equals_an_independent_bleu4():
    """A corpus with a brevity penalty: n-grams and lengths add up over lines before the
    precisions are taken (corpus BLEU, not a mean of sentence scores)."""
    rng = np.random.default_rng(0)
    words = ["a", "dog", "man", "runs", "on", "the", "grass", "red", "ball", "with"]
    hyps, refs = [], []
    for _ in range(40):
        ref = list(rng.choice(words, int(rng.integers(3, 12))))
        hyp = [w if rng.random() > 0.3 else str(rng.choice(words)) for w in ref]
        hyps.append(hyp[: len(hyp) - int(rng.integers(0, 3))])  # shorter: BP < 1
        refs.append(ref)
    score, precisions, bp = bleu4(hyps, refs)
    out = tokenized_bleu([" ".join(h) for h in hyps], [" ".join(r) for r in refs], "en")
    assert bp < 0.99 and 10 < score < 90
    assert out.score == pytest.approx(score, abs=1e-9)
    assert out.precisions == pytest.approx(precisions, abs=1e-9)
    assert out.bp == pytest.approx(bp, abs=1e-12)
    assert (out.sys_len, out.ref_len) == (sum(map(len, hyps)), sum(map(len, refs)))


@pytest.mark.parametrize(
    "raw, tokenized, lang, moses",
    [
        # German rules split at every apostrophe (English ones keep "'s" whole in "dog's").
        ("A dog's ball.", "a dog 's ball .", "de", "a dog &apos; s ball ."),
        # „“ are normalized to ", escaped as Moses escapes it.
        ("Ein Hund, der „rennt“!", 'ein hund , der " rennt " !', "de", None),
        ("Two men (in red) play.", "two men ( in red ) play .", "en", None),
    ],
)
def test_both_sides_are_lowercased_and_tokenized(raw, tokenized, lang, moses):
    expected = moses or tokenized.replace('"', "&quot;")
    assert moses_tokenize([raw, tokenized], lang) == [expected, expected]
    for hyp, ref in ((raw, tokenized), (tokenized, raw)):
        out = tokenized_bleu([hyp], [ref], lang)
        assert out.score == pytest.approx(100.0)
        assert out.sys_len == out.ref_len == len(expected.split())
    cased = tokenized_bleu([raw], [tokenized], lang, lowercase=False)
    assert cased.score < 100.0  # the capital letter then counts
    assert "lowercased" not in cased.description
    assert f"lang {lang}" in cased.description


def test_description_names_the_preprocessing():
    description = tokenized_bleu(["a"], ["a"], "fr").description
    assert description.startswith("BLEU4 on lowercased Moses-tokenized text (sacremoses ")
    assert description.endswith(", lang fr, normalized punctuation)")


def test_training_evaluation_adds_bleu_tok_beside_sacrebleu():
    """With a target language, evaluation's metrics gain bleu_tok and keep bleu as it was;
    the two differ here, where lowercasing and Moses tokenization matter."""
    from flaxformer_lite.training import evaluate

    totals = dict(tokens=4, sequences=2, nll=2.0, loss=2.0, correct=2, seq_correct=1)
    hyps, refs = ["Ein Hund's Ball.", "zwei Katzen"], ["ein Hund 's Ball .", "zwei Katzen"]
    metrics, signature, description = evaluate._corpus_metrics(
        totals, hyps, refs, wer=False, bleu=True, bleu_lang="de"
    )
    expected = tokenized_bleu(hyps, refs, "de")
    assert metrics["bleu_tok"] == expected.score == pytest.approx(100.0)
    assert description == expected.description
    assert metrics["bleu"] < 50 and "tok:13a" in signature
    without, _, none = evaluate._corpus_metrics(totals, hyps, refs, wer=False, bleu=True)
    assert "bleu_tok" not in without and none is None
    assert without == {k: v for k, v in metrics.items() if k != "bleu_tok"}
    off, _, _ = evaluate._corpus_metrics(totals, hyps, refs, wer=False, bleu=False, bleu_lang="de")
    assert not {"bleu", "bleu_tok"} & off.keys()


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")
def test_multi30k_reference_length_is_the_published_one():
    """fairseq's published test_2016_flickr output reports reflen=12103: the references
    are tokenized as the papers' were."""
    lines = (MULTI30K / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    out = tokenized_bleu(lines, lines, "de")
    assert (len(lines), out.ref_len, out.sys_len) == (1000, 12103, 12103)
    assert out.score == pytest.approx(100.0)
