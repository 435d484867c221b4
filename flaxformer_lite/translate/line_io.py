"""Text lines in and out of decoding: one output line per input line, whatever the bytes.

Input bytes are split on "\\n" only (a trailing "\\r" is dropped), bytes that
are not text (invalid UTF-8, NUL) are replaced and counted, and output text
never contains line or field separators.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from flaxformer_lite.atomic_files import atomic_write

# Every character that some reader treats as a line break, plus the n-best field separator.
_SEPARATORS = str.maketrans({c: " " for c in "\t\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


class InputError(ValueError):
    """Bad input or flags for decoding; the message says what to change."""


def read_lines(source: str | os.PathLike | BinaryIO | None) -> tuple[list[str], int]:
    """Reads text lines as decoding sees them.

    Args:
      source: a path, a binary file object, or None / "-" for standard input.
    Returns:
      (lines without their "\\n" / "\\r\\n", number of lines with bytes that are
      not text: invalid UTF-8 or NUL, each replaced by U+FFFD). A final newline
      does not make an extra empty line; an empty file gives []. Every other
      character, other line separators ("\\r", U+2028, "\\x85", "\\v", "\\f")
      included, stays inside its line.
    """
    if source is None or source == "-":
        data = sys.stdin.buffer.read()
    elif hasattr(source, "read"):
        data = source.read()
    else:
        with open(source, "rb") as f:
            data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark is not text
        data = data[3:]
    if not data:
        return [], 0
    raw = data.split(b"\n")
    if raw[-1] == b"":
        raw.pop()
    lines, invalid = [], 0
    for line in raw:
        text, bad = decode_line(line)
        invalid += bad
        lines.append(text)
    return lines, invalid


def decode_line(line: bytes) -> tuple[str, bool]:
    """One line's bytes (without its "\n") as decoding sees them: (text, whether it had
    bytes that are not text). A trailing "\r" is dropped; invalid UTF-8 and NUL become
    U+FFFD."""
    line = line.removesuffix(b"\r")
    # NUL is valid UTF-8 but never text: it marks a binary or a UTF-16 file.
    bad = b"\0" in line
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        text, bad = line.decode("utf-8", errors="replace"), True
    return text.replace("\0", "\ufffd"), bad


def stream_lines(stream: BinaryIO) -> Iterator[tuple[str, bool]]:
    """`read_lines` one line at a time: yields (text, had bytes that are not text) as soon
    as a line's "\n" (or the end of the stream) arrives, for interactive decoding.

    The same lines as `read_lines` of the whole stream: a leading byte order mark is
    dropped and a final newline makes no extra line.
    """
    first = True
    while True:
        line = stream.readline()
        if not line:
            return
        if first and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
            if not line:  # the stream held a byte order mark alone
                return
        first = False
        yield decode_line(line.removesuffix(b"\n"))


def write_lines(path: str | None, lines: Sequence[str]) -> None:
    """Writes lines as UTF-8, each ending in "\\n", to `path` or (None / "-") standard output.

    A file is written atomically, so an interrupted run never leaves a partial output file.
    """
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path is None or path == "-":
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    atomic_write(path, data)


def check_paths(inputs: Sequence[tuple[str, str | None]], output: str | None) -> None:
    """Fails before any work when an input file is missing or the output cannot be written.

    Args:
      inputs: (flag name, path) pairs; a None or "-" path is standard input.
    Raises:
      InputError: naming the flag and what to pass instead.
    """
    for name, path in inputs:
        if path not in (None, "-") and not os.path.isfile(path):
            raise InputError(f"--{name}: file {path!r} does not exist")
    if output not in (None, "-"):
        if os.path.isdir(output):
            raise InputError(f"--output: {output!r} is a directory; pass a file path")
        parent = os.path.dirname(os.path.abspath(output))
        if not os.path.isdir(parent):
            raise InputError(f"--output: directory {parent!r} does not exist")


def clean(text: str) -> str:
    """Replaces line breaks and tabs by spaces, so a hypothesis stays on its line and field."""
    return text.translate(_SEPARATORS)


def format_line(hypotheses: Sequence[tuple[str, float]], nbest: int = 1) -> str:
    """One output line: the best text, or `hyp1\\tscore1\\thyp2\\tscore2...` for nbest > 1."""
    if not hypotheses:
        return ""
    if nbest == 1:
        return clean(hypotheses[0][0])
    return "\t".join(f"{clean(text)}\t{score:.4f}" for text, score in hypotheses[:nbest])
