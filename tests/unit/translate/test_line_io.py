"""translate/line_io.py and translate/reports.py: line I/O, path checks, messages (no model)."""

import io
import os
import types

import pytest

from flaxformer_lite.translate import bucketing, line_io, reports


@pytest.mark.parametrize(
    "data, lines, invalid",
    [
        (b"", [], 0),
        (b"\n", [""], 0),
        (b"a\r\nb", ["a", "b"], 0),
        (b"\xef\xbb\xbfa\n\xffb\n", ["a", "\ufffdb"], 1),
    ],
)
def test_read_lines_from_a_file_object(data, lines, invalid):
    assert line_io.read_lines(io.BytesIO(data)) == (lines, invalid)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\n",
        b"a\r\nb",
        b"\xef\xbb\xbf",
        b"\xef\xbb\xbf\n",
        b"\xef\xbb\xbfa\n\xffb\n",
        b"a\n\n\0\rc\r",
    ],
)
def test_stream_lines_are_read_lines_one_at_a_time(data):
    lines, invalid = line_io.read_lines(io.BytesIO(data))
    streamed = list(line_io.stream_lines(io.BytesIO(data)))
    assert [text for text, _ in streamed] == lines
    assert sum(bad for _, bad in streamed) == invalid


def test_stream_lines_yields_a_line_before_the_stream_ends():
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as reader, os.fdopen(write_end, "wb") as writer:
        lines = line_io.stream_lines(reader)
        writer.write(b"first\nsec")
        writer.flush()
        assert next(lines) == ("first", False)  # the writer is still open
        writer.write(b"ond\n")
        writer.flush()
        assert next(lines) == ("second", False)
        writer.close()
        assert list(lines) == []


def test_write_lines_is_atomic_and_newline_terminated(tmp_path, capsys):
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    line_io.write_lines(str(path), ["ä", ""])
    assert path.read_bytes() == "ä\n\n".encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no temporary left
    line_io.write_lines(None, ["x"])
    assert capsys.readouterr().out == "x\n"


def test_check_paths_names_the_flag(tmp_path):
    there = tmp_path / "in.txt"
    there.write_text("a\n")
    line_io.check_paths((("input", str(there)), ("reference", None)), str(tmp_path / "out.txt"))
    line_io.check_paths((("input", "-"),), "-")
    cases = [
        ((("reference", str(tmp_path / "nope")),), None, "--reference: file"),
        ((), str(tmp_path), "is a directory"),
        ((), str(tmp_path / "no" / "out.txt"), "does not exist"),
    ]
    for inputs, output, words in cases:
        with pytest.raises(line_io.InputError, match=words):
            line_io.check_paths(inputs, output)


def test_clean_and_format_line():
    assert line_io.clean("a\u2028b\x85c\td") == "a b c d"
    assert line_io.format_line([("x", -0.5), ("y", -1.0)], nbest=2) == "x\t-0.5000\ty\t-1.0000"
    assert line_io.format_line([("x", -0.5), ("y", -1.0)]) == "x"


def test_warnings_and_summary():
    sources = bucketing.Sources(ids=[[5, 1], []], num_empty=1, num_truncated=2, num_unknown=1)
    warnings = reports.input_warnings(3, sources, 10)
    assert [w.split(" line(s)")[0] for w in warnings] == ["warning: 3", "warning: 2", "warning: 1"]
    assert reports.input_warnings(0, bucketing.Sources(ids=[]), 10) == []
    result = types.SimpleNamespace(
        hypotheses=[[("a", -1.0)], []],
        sources=sources,
        seconds=2.0,
        num_output_tokens=8,
        batch_shapes={(1, 8)},
    )
    assert reports.summary(result) == (
        "decoded 1 of 2 line(s) (1 empty) in 2.0s: 0.5 sentences/s, 4 tokens/s, 1 batch shape(s)"
    )


def test_check_attention_layer_and_line_counts():
    reports.check_attention_layer(-2, 2)
    reports.check_attention_layer(1, 2)
    for layer in (2, -3):
        with pytest.raises(line_io.InputError, match="out of range for 2 layer"):
            reports.check_attention_layer(layer, 2)
    with pytest.raises(line_io.InputError, match="--reference has 1 lines but the input has 2"):
        reports.check_line_counts(2, 1)
