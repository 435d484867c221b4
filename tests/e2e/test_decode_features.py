"""decode.py --format jsonl, --alignment and --interactive on the tiny trained workdir."""

import json
import os
import queue
import re
import subprocess
import sys
import threading

import pytest
from conftest import ROOT, run_decode

from flaxformer_lite.cli import decode as decode_cli
from flaxformer_lite.translate import line_io

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
# Normal lines, a blank line, CRLF, an over-long line, invalid UTF-8, no final newline.
MIXED = b"en 12\n\nde 45\r\nen " + b"1" * 200 + b"\nde \xff\xfe 3\n   \nen 7"
PAIRS = re.compile(r"\d+-\d+( \d+-\d+)*")
ANSWER_TIMEOUT_S = 120  # the first answer includes starting, restoring and compiling


def test_jsonl_gives_one_record_per_line_with_nbest_scores_and_alignments(trained_tiny, tmp_path):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_bytes(MIXED)
    result = run_decode(
        *("--workdir", trained_tiny, "--input", str(src), "--output", str(out)),
        *("--format", "jsonl", "--nbest", "2", "--beam_size", "2", "--alignment"),
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert result.stdout == b""
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in records] == list(range(1, 8))
    lines, _ = line_io.read_lines(str(src))
    assert [r["source"] for r in records] == lines
    for r in records:
        if not r["source"].strip():
            assert r["hypotheses"] == []
            continue
        hyps = r["hypotheses"]
        assert len(hyps) == 2 and hyps[0]["score"] >= hyps[1]["score"]
        for h in hyps:
            words = len(h["text"].split())
            assert "".join(h["tokens"]).replace("\u2581", " ").strip() == h["text"]
            assert sorted({j for _, j in h["alignment"]}) == list(range(words))


def test_text_alignment_and_interactive_answers_equal_batch_decoding(trained_tiny):
    """Greedy, text: interactive answers with --alignment, each read before the next line is
    written, are the lines batch decoding writes, each with a tab and the pairs added."""
    lines = [b"en 12", b"", b"de \xff 3", b"en " + b"1" * 200, b"de 45"]
    batch = run_decode("--workdir", trained_tiny, "--beam_size", "1", stdin=b"\n".join(lines))
    assert batch.returncode == 0, batch.stderr.decode()[-3000:]
    answers, stderr = _converse(
        ("--workdir", trained_tiny, "--beam_size", "1", "--interactive", "--alignment"), lines
    )
    assert "line 4: warning: 1 line(s) longer than 10 source tokens" in stderr
    for plain, line in zip(batch.stdout.decode().splitlines(), answers, strict=True):
        if not plain:
            assert line == ""
            continue
        text, pairs = line.split("\t")
        assert text == plain and PAIRS.fullmatch(pairs), line


def test_interactive_jsonl_beam_with_alignments(trained_tiny):
    lines = [b"de 45", b"\xff", b"", b"en 7"]
    answers, stderr = _converse(
        ("--workdir", trained_tiny, "--interactive", "--format", "jsonl"),
        ("--nbest", "2", "--beam_size", "3", "--alignment", "--alignment_layer", "0"),
        lines,
    )
    records = [json.loads(a) for a in answers]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert records[2]["hypotheses"] == []
    for r in (records[0], records[1], records[3]):
        assert [len(r["hypotheses"]), "alignment" in r["hypotheses"][0]] == [2, True]
    assert "answered 4 line(s)" in stderr


def _converse(*args_and_lines) -> tuple[list[str], str]:
    """Runs `decode.py *args`, writing each line and reading its answer before writing the
    next; returns (the answers, stderr). Every wait is bounded, so a hang fails."""
    *arg_groups, lines = args_and_lines
    args = [a for group in arg_groups for a in group]
    proc = subprocess.Popen(
        [sys.executable, "decode.py", *args],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = queue.Queue(), []
    threading.Thread(target=lambda: [out.put(x) for x in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    answers = []
    try:
        for line in lines:
            proc.stdin.write(line + b"\n")
            proc.stdin.flush()  # the input stays open: the answer cannot wait for its end
            try:
                answers.append(out.get(timeout=ANSWER_TIMEOUT_S).decode("utf-8").rstrip("\n"))
            except queue.Empty:
                pytest.fail(f"no answer to {line!r}: {b''.join(err).decode()[-3000:]}")
        proc.stdin.close()
        assert proc.wait(timeout=ANSWER_TIMEOUT_S) == 0, b"".join(err).decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.empty()  # nothing beyond one answer per line
    return answers, b"".join(err).decode()


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(interactive=True, output="out.txt"), "--output needs the whole input"),
        (
            dict(interactive=True, score=True, reference="in.txt"),
            "--reference needs the whole input",
        ),
        (dict(score=True, reference="in.txt", alignment=True), "apply to decoding"),
        (dict(format="xml"), "--format 'xml': one of text, jsonl"),
        (dict(alignment=True, alignment_layer=1), "--alignment_layer 1 is out of range for 1"),
    ],
)
def test_contradicting_flags_are_one_line_errors(trained_tiny, tmp_path, changes, words):
    (tmp_path / "in.txt").write_text("en 1\n")
    changes = {
        k: str(tmp_path / v) if k in ("output", "reference") else v for k, v in changes.items()
    }
    options = decode_cli.Options(workdir=trained_tiny, input=str(tmp_path / "in.txt"), **changes)
    with pytest.raises(line_io.InputError, match=re.escape(words)):
        decode_cli.run(options)
