"""Skipped/repeated word counts against hand-worked alignments and a brute-force edit distance."""

import itertools

import numpy as np
import pytest

from flaxformer_lite.evaluation import alignment_errors as ae


def _levenshtein(a, b):
    """Edit distance by the textbook recursion over prefixes (memoised)."""
    memo = {}

    def d(i, j):
        if (i, j) not in memo:
            if i == 0 or j == 0:
                memo[i, j] = i + j
            else:
                memo[i, j] = min(
                    d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1])
                )
        return memo[i, j]

    return d(len(a), len(b))


@pytest.mark.parametrize(
    "output, reference, skipped, repeated, substituted, inserted",
    [
        ("two hundred five", "two hundred five", 0, 0, 0, 0),
        ("two five", "two hundred five", 1, 0, 0, 0),
        ("two two hundred five", "two hundred five", 0, 1, 0, 1),
        ("two hundred hundred", "two hundred five", 0, 0, 1, 0),
        ("nine two hundred", "two hundred five", 1, 0, 0, 1),
        ("", "one", 1, 0, 0, 0),
        ("one one one", "one", 0, 2, 0, 2),
    ],
)
def test_counts_of_hand_worked_alignments(
    output, reference, skipped, repeated, substituted, inserted
):
    c = ae.alignment_counts(output, reference)
    assert (c.skipped, c.repeated, c.substituted, c.inserted) == (
        skipped,
        repeated,
        substituted,
        inserted,
    )
    assert c.outputs_either == int(skipped > 0 or repeated > 0)


def test_the_alignment_cost_is_the_edit_distance_on_random_word_lists():
    rng = np.random.default_rng(0)
    words = ["a", "b", "c"]
    for _ in range(200):
        out = list(rng.choice(words, rng.integers(0, 6)))
        ref = list(rng.choice(words, rng.integers(0, 6)))
        ops = ae.align(out, ref)
        assert sum(kind != "match" for kind, _, _ in ops) == _levenshtein(out, ref)
        # Every word of both sides appears once, in order.
        assert [i for _, i, _ in ops if i >= 0] == list(range(len(out)))
        assert [j for _, _, j in ops if j >= 0] == list(range(len(ref)))


def test_corpus_counts_sum_and_give_the_word_error_rate():
    pairs = [("two five", "two hundred five"), ("one one", "one"), ("six", "six")]
    total = ae.corpus_counts(*zip(*pairs))
    assert total.outputs == 3 and total.reference_words == 5
    assert total.word_error_rate == pytest.approx(2 / 5)
    s = total.summary()
    assert s["skip_share"] == pytest.approx(1 / 3) and s["repeat_share"] == pytest.approx(1 / 3)
    assert s["skip_or_repeat_share"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="2 outputs for 1"):
        ae.corpus_counts(["a", "b"], ["a"])


def test_the_word_error_rate_equals_jiwers_when_installed():
    jiwer = pytest.importorskip("jiwer")
    rng = np.random.default_rng(1)
    words = ["un", "deux", "trois", "cent"]
    outs, refs = [], []
    for _ in range(50):
        refs.append(" ".join(rng.choice(words, rng.integers(1, 6))))
        outs.append(" ".join(rng.choice(words, rng.integers(0, 6))))
    assert ae.corpus_counts(outs, refs).word_error_rate == pytest.approx(jiwer.wer(refs, outs))


def test_permutations_of_a_reference_never_count_as_repeats():
    for perm in itertools.permutations(["a", "b", "c"]):
        assert ae.alignment_counts(" ".join(perm), "a b c").repeated == 0


def test_the_word_error_rate_equals_the_one_row_edit_distance():
    """Two implementations: the full table with a backtrace here, one row in word_errors."""
    from flaxformer_lite.evaluation.word_errors import word_error_rate

    rng = np.random.default_rng(2)
    words = ["one", "two", "hundred", "and"]
    outs = [" ".join(rng.choice(words, rng.integers(0, 7))) for _ in range(100)]
    refs = [" ".join(rng.choice(words, rng.integers(1, 7))) for _ in range(100)]
    assert ae.corpus_counts(outs, refs).word_error_rate == pytest.approx(
        word_error_rate(outs, refs)
    )
