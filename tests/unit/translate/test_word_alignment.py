"""translate/word_alignment.py on hand-built attention matrices (no model): pieces to words,
the argmax over valid source pieces, the mean over heads, Moses-style pairs."""

import numpy as np
import pytest

from flaxformer_lite.translate import line_io, word_alignment
from flaxformer_lite.translate.word_alignment import align_attention, piece_words

EOS = None  # EOS and padding positions are None in `piece_words`' input


@pytest.mark.parametrize(
    "pieces, words",
    [
        (["▁de", "▁47", "21"], [0, 1, 1]),
        (["▁", "d", "e", "▁", "4", "7"], [0, 0, 0, 1, 1, 1]),  # a bare ▁ joins the next piece
        (["ab", "▁c"], [0, 1]),  # the first piece starts a word, ▁ or not
        (["▁a", "▁", "▁b", "▁"], [0, None, 1, None]),  # a bare ▁ with no piece to join
        (["▁a", "<unk>", "▁b", EOS, EOS], [0, 0, 1, None, None]),
        ([EOS], [None]),
        ([], []),
    ],
)
def test_pieces_start_a_new_word_at_the_boundary_mark(pieces, words):
    assert piece_words(pieces) == words


def test_words_are_the_decoded_texts_words():
    pieces = ["▁", "d", "e", "▁", "4", "7", "2", "1", "▁fünfund", "vierz", "i", "g"]
    text = "".join(pieces).replace("▁", " ").strip()
    assert max(piece_words(pieces)) + 1 == len(text.split()) == 3


def _one_hot(best, columns, heads=2, noise=0.0):
    """float32[heads, len(best), columns]: row t puts its mass on column best[t]."""
    weights = np.full((heads, len(best), columns), noise, np.float32)
    for t, s in enumerate(best):
        weights[:, t, s] += 1.0
    return weights / weights.sum(-1, keepdims=True)


def test_a_diagonal_alignment_gives_i_i_pairs():
    source = piece_words(["▁a", "▁b", "▁c", EOS])
    target = piece_words(["▁x", "▁y", "▁z", EOS])
    weights = _one_hot([0, 1, 2, 3], 4, noise=0.05)  # EOS attends to EOS
    assert align_attention(weights, source, target) == ((0, 0), (1, 1), (2, 2))
    assert word_alignment.format_pairs(((0, 0), (1, 1), (2, 2))) == "0-0 1-1 2-2"


def test_a_reordering_gives_the_permuted_pairs():
    perm = [2, 0, 3, 1]  # target word j translates source word perm[j]
    source = piece_words(["▁a", "▁b", "▁c", "▁d", EOS])
    target = piece_words(["▁w", "▁x", "▁y", "▁z", EOS])
    pairs = align_attention(_one_hot([*perm, 4], 5, noise=0.1), source, target)
    assert pairs == tuple(sorted((i, j) for j, i in enumerate(perm)))
    assert word_alignment.format_pairs(pairs) == "0-1 1-3 2-0 3-2"


def test_words_of_several_pieces_take_every_pieces_link():
    # Source words: 0 = "▁ab" + "c", 1 = "▁d", 2 = "▁e"; target words 0, 1, 2 of one piece
    # each, then a word of two pieces that attend to two different source words.
    source = piece_words(["▁ab", "c", "▁d", "▁e", EOS])
    target = piece_words(["▁x", "▁y", "▁z", "▁w", "v", EOS])
    best = [3, 0, 2, 1, 3, 4]  # source pieces: e, ab, d, c, e, EOS
    pairs = align_attention(_one_hot(best, 5), source, target)
    assert pairs == ((0, 1), (0, 3), (1, 2), (2, 0), (2, 3))
    every_target_word = {j for _, j in pairs}
    assert every_target_word == {0, 1, 2, 3}


def test_eos_and_padding_columns_are_never_linked():
    """A row that attends mostly to EOS (or to padding past the source) is linked to its
    best real source piece."""
    source = piece_words(["▁a", "▁b", EOS])
    target = piece_words(["▁x", "▁y", EOS])
    weights = np.array([[0.1, 0.2, 0.7, 0.0], [0.3, 0.1, 0.0, 0.6], [0, 0, 1, 0]], np.float32)
    assert align_attention(weights, source, target) == ((0, 1), (1, 0))


def test_heads_are_averaged_before_the_argmax():
    source = piece_words(["▁a", "▁b", EOS])
    target = piece_words(["▁x", EOS])
    heads = np.array(
        [[[0.6, 0.4, 0.0], [0, 0, 1]], [[0.6, 0.4, 0.0], [0, 0, 1]], [[0.0, 1.0, 0.0], [0, 0, 1]]],
        np.float32,
    )  # [3 heads, T, S]: two heads prefer a by 0.2, one prefers b by 1
    assert align_attention(heads, source, target) == ((1, 0),)  # mean: a 0.4, b 0.6
    assert align_attention(heads[:2], source, target) == ((0, 0),)


def test_a_source_without_words_gives_no_pairs():
    assert align_attention(_one_hot([0, 0], 1), [None], [0, None]) == ()


def test_the_layer_is_checked():
    word_alignment.check_layer(-1, 1)
    word_alignment.check_layer(1, 2)
    for layer in (2, -3):
        with pytest.raises(line_io.InputError, match=f"--alignment_layer {layer} is out"):
            word_alignment.check_layer(layer, 2)
