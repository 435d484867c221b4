"""Word error rate by our edit distance, against hand-counted cases and jiwer."""

import numpy as np
import pytest

from flaxformer_lite.evaluation.word_errors import edit_distance, word_error_rate


@pytest.mark.parametrize(
    "hyp, ref, edits",
    [
        ("", "", 0),
        ("a b c", "a b c", 0),
        ("a x c", "a b c", 1),  # substitution
        ("a c", "a b c", 1),  # deletion
        ("a b b c", "a b c", 1),  # insertion
        ("c b a", "a b c", 2),
        ("", "one two", 2),
        ("one two", "", 2),
    ],
)
def test_edit_distance_by_hand(hyp, ref, edits):
    assert edit_distance(hyp.split(), ref.split()) == edits


def test_corpus_wer_equals_jiwer():
    jiwer = pytest.importorskip("jiwer")
    rng = np.random.default_rng(0)
    words = ["one", "two", "three", "hundred", "and", "thousand", "four"]
    refs, hyps = [], []
    for _ in range(200):
        ref = list(rng.choice(words, int(rng.integers(1, 8))))
        hyp = [w for w in ref if rng.random() > 0.2]  # deletions
        for _ in range(int(rng.integers(0, 3))):  # insertions and substitutions
            position = int(rng.integers(0, len(hyp) + 1))
            if rng.random() < 0.5 and position < len(hyp):
                hyp[position] = str(rng.choice(words))
            else:
                hyp.insert(position, str(rng.choice(words)))
        refs.append(" ".join(ref))
        hyps.append(" ".join(hyp))
    assert word_error_rate(hyps, refs) == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)
    for h, r in zip(hyps[:50], refs[:50]):
        assert word_error_rate([h], [r]) == pytest.approx(jiwer.wer(r, h), abs=1e-12)
