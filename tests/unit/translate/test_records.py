"""translate/records.py: one record per input line, as text or JSON (no model)."""

import json
import types

import pytest

from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.translate import bucketing, line_io, records
from flaxformer_lite.translate.records import DecodedLine, Hypothesis


class _Pieces:
    """A target vocabulary stand-in: id k is the piece PIECES[k]."""

    PIECES = ["<pad>", "<unk>", "<s>", "</s>", "▁a", "b", "▁c"]
    vocab_size = len(PIECES)

    def id_to_piece(self, token):
        return self.PIECES[token]


def _result(hypotheses, nbest_ids, oov=None):
    sources = bucketing.Sources(ids=[[5, EOS_ID] if h else [] for h in hypotheses], oov=oov)
    return types.SimpleNamespace(hypotheses=hypotheses, nbest_ids=nbest_ids, sources=sources)


LINES = [
    DecodedLine(1, "x y", (Hypothesis("ab c", -0.5, ("▁a", "b", "▁c"), ((0, 0), (1, 1))),)),
    DecodedLine(2, "", ()),
    DecodedLine(3, "z\u2028", (Hypothesis("a\tb\u2028", None, ("▁a",), ()),)),
]


def test_records_of_a_decode_result_keep_every_line_and_its_pieces():
    result = _result(
        [[("ab c", -0.5), ("a", -0.9)], []],
        [[[4, 5, 6, EOS_ID], [4, EOS_ID]], []],
    )
    pairs = [[((0, 0), (0, 1)), ((0, 0),)], []]
    got = records.decoded_lines(result, ["x", ""], _Pieces(), alignments=pairs, first_number=7)
    assert [(d.number, d.source) for d in got] == [(7, "x"), (8, "")]
    assert got[0].hypotheses == (
        Hypothesis("ab c", -0.5, ("▁a", "b", "▁c"), ((0, 0), (0, 1))),
        Hypothesis("a", -0.9, ("▁a",), ((0, 0),)),
    )
    assert got[1].hypotheses == ()
    unscored = records.decoded_lines(result, ["x", ""], _Pieces(), scored=False)
    assert [h.score for h in unscored[0].hypotheses] == [None, None]
    assert unscored[0].hypotheses[0].alignment is None


def test_a_copy_heads_extended_ids_show_their_lines_unknown_piece():
    result = _result([[("Žb", -1.0)]], [[[7, 5, EOS_ID]]], oov=[("Ž",)])
    (line,) = records.decoded_lines(result, ["Ž"], _Pieces())
    assert line.hypotheses[0].tokens == ("Ž", "b")


def test_text_lines_without_alignments_are_format_lines_line():
    for line in LINES:
        plain = DecodedLine(
            line.number,
            line.source,
            tuple(Hypothesis(h.text, h.score, h.tokens) for h in line.hypotheses),
        )
        for nbest in (1, 2):
            want = line_io.format_line([(h.text, h.score or 0.0) for h in plain.hypotheses], nbest)
            assert records.format_record(plain, "text", nbest) == want


def test_text_lines_put_the_pairs_after_each_hypothesis():
    two = DecodedLine(
        1,
        "x",
        (Hypothesis("ab", -0.5, ("▁a", "b"), ((0, 0),)), Hypothesis("c", -1.0, ("▁c",), ())),
    )
    assert records.text_line(LINES[0]) == "ab c\t0-0 1-1"
    assert records.text_line(two, nbest=2) == "ab\t0-0\t-0.5000\tc\t\t-1.0000"
    assert records.text_line(two, nbest=1) == "ab\t0-0"
    assert records.text_line(LINES[1]) == ""
    assert records.text_line(LINES[2]) == "a b \t"  # separators become spaces


def test_json_lines_are_one_line_each_and_read_back():
    text = "\n".join(records.format_record(line, "jsonl") for line in LINES)
    assert len(text.splitlines()) == len(LINES)  # U+2028 is escaped
    got = [json.loads(line) for line in text.splitlines()]
    assert got[0] == {
        "line": 1,
        "source": "x y",
        "hypotheses": [
            {
                "text": "ab c",
                "score": -0.5,
                "tokens": ["▁a", "b", "▁c"],
                "alignment": [[0, 0], [1, 1]],
            }
        ],
    }
    assert got[1] == {"line": 2, "source": "", "hypotheses": []}
    assert got[2]["hypotheses"][0]["text"] == "a\tb\u2028" and got[2]["source"] == "z\u2028"
    assert got[2]["hypotheses"][0]["score"] is None
    refused = DecodedLine(4, "long", (), error="too long")
    assert json.loads(records.jsonl_line(refused))["error"] == "too long"
    assert records.text_line(refused) == ""
    with pytest.raises(ValueError, match="unknown output format"):
        records.format_record(refused, "xml")
