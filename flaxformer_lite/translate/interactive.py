"""Interactive decoding: each input line answered, and flushed, as soon as it arrives.

`decode.py --interactive` (and decode.py on a terminal) reads a stream line by
line and writes one output line per input line before reading the next, so a
person at a terminal, or a program that writes a line and waits for its
answer, never waits for the end of the input. Lines are decoded one at a time
(a batch of one row per length bucket: each bucket compiles once, on its first
line). A line that cannot be decoded (over-long under --strict, a speech
workdir's missing WAV file) still gets its output line: empty in text, a
record with an "error" field in JSON, and one `error:` line on stderr.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO

from flaxformer_lite.translate import line_io, records, reports
from flaxformer_lite.translate.line_decoder import LineDecoder


def answer(
    decoder: LineDecoder, text: str, number: int, log: Callable[[str], object], bad: bool = False
) -> records.DecodedLine:
    """The record of input line `number` (1-based), decoded alone; warnings and a refusal
    go to `log`, prefixed with the line number.

    `bad`: the line had bytes that are not text (`line_io.decode_line`).
    """
    try:
        (line,), result = decoder.decode([text], first_number=number)
    except line_io.InputError as e:
        log(f"error: {e}")
        return records.DecodedLine(number, text, (), error=str(e))
    max_source_len = decoder.run_config.data.max_source_len
    for warning in reports.input_warnings(int(bad), result.sources, max_source_len):
        log(f"line {number}: {warning}")
    return line


def serve(
    decoder: LineDecoder,
    stream_in: BinaryIO,
    stream_out: BinaryIO,
    *,
    output_format: str = "text",
    log: Callable[[str], object] = lambda message: None,
) -> int:
    """Answers every line of `stream_in` on `stream_out`, flushing each answer before
    reading the next line; returns the number of lines answered.

    Args:
      stream_in: binary, read with `line_io.stream_lines` (a line ends at "\\n").
      stream_out: binary; gets UTF-8 lines, each ending in "\\n".
      output_format: one of `records.FORMATS`.
    """
    number = 0
    for number, (text, bad) in enumerate(line_io.stream_lines(stream_in), start=1):
        line = answer(decoder, text, number, log, bad)
        out = records.format_record(line, output_format, decoder.nbest) + "\n"
        stream_out.write(out.encode("utf-8"))
        stream_out.flush()
    return number
