"""One input line's decoding as a record, and that record as an output line (text or JSON).

`decode.py --format text` (the default) writes `line_io.format_line`'s line,
with `--alignment` a tab and the Moses-style pairs after each hypothesis;
`--format jsonl` writes one JSON object per input line. Every input line gives
exactly one record, blank and refused lines included, so output line k always
answers input line k.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.translate import line_io, word_alignment

FORMATS = ("text", "jsonl")
# Characters that JSON leaves unescaped but some line readers split on (Python's
# str.splitlines, JavaScript before ES2019): escaped, so a record stays one line.
_JSON_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x1c\x1d\x1e\x85\u2028\u2029"})


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One decoded hypothesis of a line."""

    text: str
    score: float | None  # what the search ranks by (None: greedy and sampling track none)
    tokens: tuple[str, ...]  # the generated pieces, EOS left out
    alignment: word_alignment.Pairs | None = None  # (source word, target word); None: not asked


@dataclasses.dataclass(frozen=True)
class DecodedLine:
    """Everything decoding says about one input line."""

    number: int  # 1-based, as in error messages
    source: str  # the input line as decoded (invalid bytes as U+FFFD)
    hypotheses: tuple[Hypothesis, ...]  # best first; () for a blank or refused line
    error: str | None = None  # why a line was refused (interactive --strict, a bad WAV path)


def decoded_lines(
    result,
    lines: Sequence[str],
    target_vocab: Tokenizer,
    *,
    scored: bool = True,
    alignments: Sequence[Sequence[word_alignment.Pairs]] | None = None,
    first_number: int = 1,
) -> list[DecodedLine]:
    """The records of a `runner.DecodeResult`, one per line of `lines`, in order.

    Args:
      result: decoding of `lines` (its `hypotheses`, `nbest_ids`, `sources.oov`).
      scored: whether the search's scores mean something (False: they become None).
      alignments: per line, per hypothesis (`word_alignment.align_hypotheses`).
      first_number: the number of `lines[0]`.
    """
    piece = ExtendedVocabulary(target_vocab).piece
    out = []
    for i, line in enumerate(lines):
        unknown = result.sources.oov[i] if result.sources.oov is not None else ()
        hyps = []
        for k, (text, score) in enumerate(result.hypotheses[i]):
            ids = result.nbest_ids[i][k]
            tokens = tuple(piece(t, unknown) for t in ids if t not in (EOS_ID, PAD_ID, BOS_ID))
            pairs = alignments[i][k] if alignments is not None else None
            hyps.append(Hypothesis(text, score if scored else None, tokens, pairs))
        out.append(DecodedLine(first_number + i, line, tuple(hyps)))
    return out


def as_dict(line: DecodedLine) -> dict:
    """The JSON object of one line: {"line", "source", "hypotheses": [{"text", "score",
    "tokens"[, "alignment"]}, ...][, "error"]}; "alignment" is a list of [i, j] pairs."""
    hyps = []
    for h in line.hypotheses:
        score = None if h.score is None else round(h.score, 4)
        hyp = {"text": h.text, "score": score, "tokens": list(h.tokens)}
        if h.alignment is not None:
            hyp["alignment"] = [list(p) for p in h.alignment]
        hyps.append(hyp)
    record = {"line": line.number, "source": line.source, "hypotheses": hyps}
    if line.error is not None:
        record["error"] = line.error
    return record


def jsonl_line(line: DecodedLine) -> str:
    """One line of JSON (UTF-8 text, no line breaks inside)."""
    text = json.dumps(as_dict(line), ensure_ascii=False)
    return text.translate(_JSON_LINE_BREAKS)


def text_line(line: DecodedLine, nbest: int = 1) -> str:
    """The text format: `line_io.format_line`'s line, or with alignments `hyp<TAB>pairs`
    (nbest 1) / `hyp1<TAB>pairs1<TAB>score1<TAB>hyp2...` (nbest > 1); "" for no hypothesis."""
    hyps = line.hypotheses[:nbest]
    if not hyps or hyps[0].alignment is None:
        return line_io.format_line([(h.text, h.score or 0.0) for h in hyps], nbest)
    fields = []
    for h in hyps:
        fields += [line_io.clean(h.text), word_alignment.format_pairs(h.alignment)]
        if nbest > 1:
            fields.append(f"{h.score or 0.0:.4f}")
    return "\t".join(fields)


def format_record(line: DecodedLine, output_format: str, nbest: int = 1) -> str:
    """`text_line` or `jsonl_line`, by `output_format` (one of FORMATS)."""
    if output_format == "jsonl":
        return jsonl_line(line)
    if output_format == "text":
        return text_line(line, nbest)
    raise ValueError(f"unknown output format {output_format!r}: one of {FORMATS}")
