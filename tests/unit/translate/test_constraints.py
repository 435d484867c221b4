"""translate/constraints.py and decode.py --constraints on the tiny trained workdir: phrases
tokenized as words, one-line refusals, outputs holding words the plain output lacks, lines
without phrases decoded as plain beam search decodes them."""

import re

import numpy as np
import pytest

from flaxformer_lite.cli import decode as decode_cli
from flaxformer_lite.models import from_config, predict
from flaxformer_lite.search.primitives import NEG_INF
from flaxformer_lite.translate import constraints, runner
from flaxformer_lite.translate.line_io import InputError

LINES = ["en 47", "de 12", "", "en 5", "de 80", "en 93"]
WORDS = ["forty", "zwölf", "seventy", "achtzig", "fifty-six"]  # a phrase the output lacks


@pytest.fixture(scope="module")
def loaded(trained_tiny):
    from flaxformer_lite.training import restore

    run_config, vocab = runner.open_workdir(trained_tiny)
    params, _ = restore.restore_params(trained_tiny, None, log=lambda s: None)
    return from_config.build_model(run_config), params, vocab, run_config


def _contains(seq, part) -> bool:
    seq, part = list(seq), list(part)
    return any(seq[s : s + len(part)] == part for s in range(len(seq) - len(part) + 1))


def test_a_phrase_is_tokenized_as_a_word_in_mid_sentence(loaded):
    target = loaded[2].target
    phrases = ["forty", "seven", "neunundvierzig", "forty-seven"]
    (ids,) = constraints.tokenize_phrases(target, [phrases], max_len=64)
    for phrase, tokens in zip(phrases, ids):
        assert target.id_to_piece(tokens[0]).startswith("▁"), phrase
        assert _contains(target.encode(f"eins {phrase} zwei"), tokens), phrase
        assert target.encode(phrase)[: len(tokens)] == tokens  # and at a sentence start
    # A word start, never inside a word: "seven" is not in "forty-seven"'s pieces.
    assert not _contains(ids[3], ids[1])


@pytest.mark.parametrize(
    "phrases, words",
    [
        ([[], ["forty", "Q€"]], "constraints line 2: the target vocabulary cannot spell 'Q€'"),
        ([["a"] * 9], "constraints line 1: 9 phrases; at most 8 per line"),
        ([["x" * 16]], "constraints line 1: 'xxxxxxxxxxxxxxxx' is 17 target tokens; at most 16"),
        ([["xxxx", "yyyy"]], "the phrases take 10 target tokens, leaving no room for EOS within"),
    ],
)
def test_bad_phrases_are_refused_in_one_line(loaded, phrases, words):
    with pytest.raises(InputError) as e:
        constraints.tokenize_phrases(loaded[2].target, phrases, max_len=10)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_phrase_files_split_on_tabs_and_match_the_input(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("forty\t seven \t\n\n\tzwölf\n", encoding="utf-8")
    assert constraints.read_phrases(str(path), 3) == [["forty", "seven"], [], ["zwölf"]]
    with pytest.raises(InputError, match="--constraints has 3 lines but the input has 4"):
        constraints.read_phrases(str(path), 4)


def test_phrases_pad_to_powers_of_two():
    ids = [[[5, 6, 7], [8]], [], [[9], [10], [11]]]
    assert constraints.padded_shape(ids) == (4, 4)
    assert constraints.padded_shape([[], []]) == (1, 1)
    tokens, lengths = constraints.pad_phrases(ids, [2, 0], 3, (4, 4))
    assert tokens.shape == (3, 4, 4) and lengths.tolist() == [[1, 1, 1, 0], [3, 1, 0, 0], [0] * 4]
    assert tokens[1, 0].tolist() == [5, 6, 7, 0] and tokens[0, 2, 0] == 11


def _search(run_config):
    return runner.make_search(run_config, beam_size=3, nbest=2)


def test_outputs_hold_words_the_plain_output_lacks(loaded):
    model, params, vocab, run_config = loaded
    search = _search(run_config)
    plain = runner.decode_lines(model, params, vocab, run_config, LINES, search=search, nbest=2)
    # For lines 1, 4 and 6 a word the plain 1-best lacks (as pieces); none for the others.
    phrases = [[] for _ in LINES]
    for i in (0, 3, 5):
        phrases[i] = [next(w for w in WORDS if w not in plain.texts[i])]
    ids = constraints.tokenize_phrases(vocab.target, phrases, search.max_len)
    result, unmet = constraints.decode_lines(
        *(model, params, vocab, run_config, LINES, ids), search=search, nbest=2
    )
    assert unmet == [] and result.hypotheses[2] == []
    for i in (0, 3, 5):
        assert len(result.hypotheses[i]) >= 1
        for (text, _), hyp_ids in zip(result.hypotheses[i], result.nbest_ids[i]):
            assert _contains(hyp_ids, ids[i][0]), (text, phrases[i])
            assert re.search(rf"(^|\s){re.escape(phrases[i][0])}", text), (text, phrases[i])
    for i in (1, 4):  # no phrases: beam search's n-best exactly
        assert result.nbest_ids[i] == plain.nbest_ids[i]
        np.testing.assert_allclose(
            [s for _, s in result.hypotheses[i]], [s for _, s in plain.hypotheses[i]], rtol=1e-5
        )


def test_lines_no_hypothesis_satisfies_are_decoded_without_phrases(loaded, monkeypatch):
    """A search that meets no line's phrases (every slot NEG_INF): those lines get the plain
    output and are reported; lines without phrases are decoded once."""
    model, params, vocab, run_config = loaded
    real, calls = predict.decode_with_constraints, []

    def never_met(model, params, inputs, phrases, lengths, **kw):
        tokens, scores = real(model, params, inputs, phrases, lengths, **kw)
        calls.append(int(np.asarray(lengths).sum()))
        rows_with_phrases = np.asarray(lengths).sum(axis=1) > 0
        return tokens, np.where(rows_with_phrases[:, None], NEG_INF, scores)

    monkeypatch.setattr(constraints.predict, "decode_with_constraints", never_met)
    search = _search(run_config)
    phrases = [["forty"], [], [], [], ["achtzig"], []]
    ids = constraints.tokenize_phrases(vocab.target, phrases, search.max_len)
    result, unmet = constraints.decode_lines(
        *(model, params, vocab, run_config, LINES, ids), search=search, nbest=2
    )
    plain = runner.decode_lines(model, params, vocab, run_config, LINES, search=search, nbest=2)
    assert unmet == [0, 4] and calls[-1] == 0  # the second pass has no phrases
    assert result.nbest_ids == plain.nbest_ids
    assert "2 line(s) have no output holding all their phrases within 16 tokens (line 1, 5)" in (
        constraints.unmet_warning(unmet, 16)
    )


def test_decode_constrained_gives_nbest_text_per_line(loaded):
    model, params, vocab, run_config = loaded
    phrases = [["forty"], ["zwölf"], ["forty"], [], [], ["seventy", "three"]]
    out = constraints.decode_constrained(
        *(model, params, vocab, run_config, LINES, phrases), beam_size=3, nbest=2
    )
    assert len(out) == len(LINES) and out[2] == []
    for i in (0, 1, 5):
        for text, score in out[i]:
            assert all(re.search(rf"(^|\s){p}", text) for p in phrases[i]), text
            assert score < 0
    with pytest.raises(InputError, match="cannot spell"):
        constraints.decode_constrained(model, params, vocab, run_config, ["en 1"], [["€"]])


def test_decode_cli_writes_one_line_per_input_and_refuses_in_one_line(trained_tiny, tmp_path):
    src, terms, out = tmp_path / "in.txt", tmp_path / "terms.txt", tmp_path / "out.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    terms.write_text("forty\n\nzwölf\n\nachtzig\tfünf\n\n", encoding="utf-8")
    options = dict(workdir=trained_tiny, input=str(src), output=str(out), beam_size=3)
    decode_cli.run(decode_cli.Options(**options, constraints=str(terms)))
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines.pop() == "" and len(lines) == len(LINES) and lines[2] == ""
    assert re.search(r"(^|\s)forty", lines[0]), lines[0]
    assert re.search(r"(^|\s)achtzig", lines[4]) and re.search(r"(^|\s)fünf", lines[4])
    terms.write_text("forty\n", encoding="utf-8")
    bad = [
        (dict(constraints=str(terms)), "--constraints has 1 lines but the input has 6"),
        (dict(constraints=str(tmp_path / "no")), "--constraints: file"),
        (dict(constraints=str(terms), temperature=1.0), "--temperature does not apply"),
        (dict(constraints=str(terms), interactive=True), "--constraints needs the whole input"),
    ]
    for extra, words in bad:
        with pytest.raises(InputError, match=re.escape(words)):
            decode_cli.run(decode_cli.Options(**(options | extra)))
