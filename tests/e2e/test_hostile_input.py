"""Hostile input on one tiny trained workdir.

Input text: whatever the bytes, decoding writes one output line per input line,
in order, and counts what it had to repair. Workdir files: nothing is
unpickled while loading a run, and a corrupted vocabulary or run config is
refused with one error line.
"""

import _pickle
import contextlib
import io
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
from unittest import mock

import numpy as np
import pytest
from conftest import ROOT
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flaxformer_lite.cli import decode as decode_cli
from flaxformer_lite.models import from_config
from flaxformer_lite.training.workdir import RUN_CONFIG, WorkdirError, load_run_config
from flaxformer_lite.translate import bucketing, line_io, runner

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
BOM = b"\xef\xbb\xbf"
LONG = b"en " + b"7" * 10_000  # far beyond the tiny model's 10 source tokens
# Pieces of hostile lines: characters that other readers take for line breaks (a lone CR,
# U+2028, NEL, VT, FF), NUL, invalid UTF-8 (a stray byte, a cut sequence, an encoded
# surrogate), a byte order mark inside the text, and plain text the model knows.
FRAGMENTS = (
    b"en 12",
    b"de 45",
    b" ",
    b"\t",
    b"\0",
    b"\r",
    "\u2028".encode(),
    "\x85".encode(),
    b"\v",
    b"\f",
    b"\xff",
    b"\xc3",
    b"\xed\xa0\x80",
    BOM,
    LONG,
)
# Every case in one file, CRLF and LF mixed, without a final newline.
ALL_CASES = (
    BOM
    + b"\r\n".join(
        [
            b"en 12",
            b"",
            b"de 4\0 5",
            b"en \r 7",
            "de 3\u2028\x85\v\f4".encode(),
            LONG,
            b"de \xff\xfe 3",
            b"\xed\xa0\x80 en 1",
            b"\0",
            b"   ",
            b"en " + BOM + b"9",
            b"\xc3",
        ]
    )
    + b"\nen 8"
)

line_bytes = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=6)), max_size=4).map(
    b"".join
)


@st.composite
def hostile_files(draw) -> bytes:
    """Random bytes, or lines of fragments ending in LF or CRLF, with or without a BOM
    and a final newline."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    ends = st.sampled_from([b"\n", b"\r\n"])
    data = b"".join(a + b for a, b in draw(st.lists(st.tuples(line_bytes, ends), max_size=8)))
    if draw(st.booleans()):
        data = data.removesuffix(b"\n")
    return (BOM if draw(st.booleans()) else b"") + data


def expected_lines(data: bytes) -> list[bytes]:
    """The input lines by definition: split on LF only, a final LF adds no line, an empty
    file (or a lone BOM) has none; each line without its LF or CRLF."""
    body = data.removeprefix(BOM)
    count = body.count(b"\n") + (body != b"" and not body.endswith(b"\n"))
    lines = [line.removesuffix(b"\r") for line in body.split(b"\n")[:count]]
    assert len(lines) == count
    return lines


def is_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def workdir(trained_tiny):
    """The shared tiny run (read, never written; tests that corrupt it copy it): decoding
    needs a checkpoint, not a good model, and several, so that averaging is a loading path too."""
    return trained_tiny


@pytest.fixture(scope="module")
def loaded(workdir):
    from flaxformer_lite.training import restore

    run_config, vocab = runner.open_workdir(workdir)
    params, _ = restore.restore_params(workdir)
    return from_config.build_model(run_config), params, vocab, run_config


def decode_file(workdir: str, data: bytes, directory: str, params=None):
    """What decode.py does with `data` as --input: (output bytes, messages on stderr).

    `params`: the checkpoint's parameters, to skip reading them again (None: read them).
    """
    from flaxformer_lite.training import restore

    src, out = os.path.join(directory, "in.txt"), os.path.join(directory, "out.txt")
    with open(src, "wb") as f:
        f.write(data)
    messages = []
    options = decode_cli.Options(workdir=workdir, input=src, output=out, beam_size=1, batch_size=2)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(decode_cli, "log", messages.append))
        if params is not None:
            read = mock.patch.object(restore, "restore_params", return_value=(params, None))
            stack.enter_context(read)
        decode_cli.run(options)
    with open(out, "rb") as f:
        return f.read(), messages


def warning_count(messages: list[str], words: str) -> int:
    found = [m for m in messages if m.startswith("warning: ") and words in m]
    assert len(found) <= 1, messages
    return int(re.match(r"warning: (\d+) line", found[0]).group(1)) if found else 0


@pytest.fixture(scope="module")
def decode_alone(loaded):
    """text -> its output line when decoded as the only line (memoized)."""
    model, params, vocab, run_config = loaded
    search = runner.make_search(run_config, beam_size=1)
    memo = {}

    def decode(text: str) -> str:
        if text not in memo:
            result = runner.decode_lines(model, params, vocab, run_config, [text], search=search)
            memo[text] = line_io.format_line(result.hypotheses[0])
        return memo[text]

    return decode


def check_decoded(data, output, messages, vocab, run_config, decode_alone) -> None:
    """One output line per input line, each the decoding of its line alone, and one
    warning per kind of repaired input with the number of lines it was injected in."""
    raw = expected_lines(data)
    assert output.count(b"\n") == len(raw), (output, messages)
    assert output.endswith(b"\n") or not raw
    text = output.decode("utf-8")
    # No other character that some reader takes for a line break either.
    assert len(text.splitlines()) == len(raw)
    outputs = text.split("\n")[:-1]

    lines, num_bad = line_io.read_lines(io.BytesIO(data))
    assert lines == [r.decode("utf-8", "replace").replace("\0", "\ufffd") for r in raw]
    assert num_bad == sum(b"\0" in r or not is_utf8(r) for r in raw)
    assert warning_count(messages, "invalid UTF-8 or NUL bytes") == num_bad
    max_len = run_config.data.max_source_len
    too_long = sum(bool(t.strip()) and len(vocab.source.encode(t)) >= max_len for t in lines)
    assert warning_count(messages, "were truncated") == too_long
    for line, got in zip(lines, outputs, strict=True):
        assert got == decode_alone(line), line


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return str(tmp_path_factory.mktemp("scratch"))


@pytest.fixture(scope="module")
def compilations():
    """The backend compilations of the runner's jitted search while the module runs."""
    import jax

    compiled = []

    def listener(event, seconds, **kw):
        name = f"jit({runner.predict_batch.__name__})"
        if event == "/jax/core/compile/backend_compile_duration" and kw.get("fun_name") == name:
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield compiled
    jax.monitoring.unregister_event_duration_listener(listener)


# Each example decodes a file in process. Compilations stay bounded: batches have 1 or 2
# rows (batch_size=2), and the runner pads sources to one of a few bucket lengths.
@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=hostile_files())
@example(data=ALL_CASES)
@example(data=b"")
@example(data=BOM)
@example(data=b"\n\r\n\r")
def test_any_bytes_give_one_output_line_per_input_line(
    data, workdir, loaded, decode_alone, scratch, compilations
):
    _, params, vocab, run_config = loaded
    output, messages = decode_file(workdir, data, scratch, params)
    check_decoded(data, output, messages, vocab, run_config, decode_alone)
    buckets = bucketing.bucket_lengths(run_config.data.max_source_len)
    assert len(compilations) <= 2 * len(buckets)


def test_decode_cli_on_every_hostile_case(workdir, loaded, decode_alone, tmp_path):
    _, _, vocab, run_config = loaded
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes(ALL_CASES)
    result = subprocess.run(
        [sys.executable, "decode.py", "--workdir", workdir, "--input", str(src)]
        + ["--output", str(out), "--beam_size", "1", "--batch_size", "2"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        timeout=300,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-3000:]
    messages = stderr.splitlines()
    assert warning_count(messages, "invalid UTF-8 or NUL bytes") == 5
    assert warning_count(messages, "were truncated") == 1
    assert "decoded 11 of 13 line(s) (2 empty)" in stderr
    check_decoded(ALL_CASES, out.read_bytes(), messages, vocab, run_config, decode_alone)


# ----------------------------------------------------------------------------
# Workdir files: loaded without pickle, refused in one line when corrupted.
# ----------------------------------------------------------------------------

PRE_BOUND_LOADS = pickle.loads  # as a module that did `from pickle import loads` holds it


class Unpickled(Exception):
    """Something tried to unpickle while a workdir was loaded."""


@contextlib.contextmanager
def unpickling_forbidden(monkeypatch):
    """Makes every way into pickle raise `Unpickled`, and yields the list of attempts.

    pickle's (and _pickle's) load, loads and Unpickler, and numpy.load with
    allow_pickle=True, are replaced; references bound before the patch are caught
    by the "pickle.find_class" audit event, which unpickling anything but plain
    builtins raises (audit hooks cannot be removed: this one stops at the exit).
    """
    attempts = []

    def refuse(name):
        def refused(*args, **kwargs):
            attempts.append(name)
            raise Unpickled(name)

        return refused

    for module in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler", "_load", "_loads", "_Unpickler"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse(f"{module.__name__}.{name}"))
    numpy_load = np.load

    def load(*args, allow_pickle=False, **kwargs):
        if allow_pickle:
            refuse("numpy.load(allow_pickle=True)")()
        return numpy_load(*args, allow_pickle=allow_pickle, **kwargs)

    monkeypatch.setattr(np, "load", load)
    active = threading.Event()
    active.set()

    def hook(event, args):
        if event == "pickle.find_class" and active.is_set():
            refuse(f"{event}{args}")()

    sys.addaudithook(hook)
    try:
        yield attempts
    finally:
        active.clear()


def test_loading_a_workdir_never_unpickles(workdir, tmp_path, monkeypatch):
    import jax

    from flaxformer_lite.data import tokenizer
    from flaxformer_lite.training import load_state, restore

    with unpickling_forbidden(monkeypatch) as attempts:
        # The guard holds, for a reference bound before it too.
        for loads in (pickle.loads, PRE_BOUND_LOADS):
            with pytest.raises(Unpickled):
                loads(pickle.dumps(np.arange(3)))
        attempts.clear()

        run_config = load_run_config(workdir)
        vocab = tokenizer.Vocabularies.load(workdir)
        _, state, _, _ = load_state.restore_trained(workdir)
        params, _ = restore.restore_params(workdir)
        averaged, _ = restore.restore_params(workdir, average=2)
        # And everything decode.py reads, through to a decoded line.
        output, messages = decode_file(workdir, b"en 12\n", str(tmp_path))
    assert attempts == []
    assert run_config.model.vocab_size == vocab.source.vocab_size
    assert output.count(b"\n") == 1 and output != b"\n", messages
    for a, b, c in zip(*map(jax.tree.leaves, (state.params, params, averaged))):
        np.testing.assert_array_equal(a, b)
        assert a.shape == c.shape


def copy_workdir(workdir: str, tmp_path) -> str:
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    return copy


@pytest.mark.parametrize("case", ["empty", "truncated", "text", "pickle", "directory"])
def test_corrupted_vocabulary_is_refused_in_one_line(workdir, tmp_path, case):
    from flaxformer_lite.cli import common
    from flaxformer_lite.data import tokenizer
    from flaxformer_lite.training import load_state

    with pytest.raises(tokenizer.VocabularyFileError):  # not a traceback of SentencePiece's
        tokenizer.Tokenizer.load(__file__)
    copy = copy_workdir(workdir, tmp_path)
    path = os.path.join(copy, tokenizer.SHARED_VOCAB_FILE)
    with open(path, "rb") as f:
        model = f.read()
    os.remove(path)
    if case == "directory":
        os.mkdir(path)
    else:
        content = {
            "empty": b"",
            "truncated": model[: len(model) // 2],
            "text": b"en 12\tzwoelf\n",
            "pickle": pickle.dumps({"pieces": ["<pad>"]}),
        }[case]
        with open(path, "wb") as f:
            f.write(content)
    for load in (runner.open_workdir, load_state.restore_trained):
        # The command lines print these as one `error: ...` line, exit status 2.
        with pytest.raises(common.user_errors()) as raised:
            load(copy)
        message = str(raised.value)
        assert path in message and "\n" not in message and "INTERNAL" not in message
        assert ("cannot be read" if case == "directory" else "is corrupted") in message


@pytest.mark.parametrize("content", [b"{", b"\xff", b"[1, 2]", b'"run"', b"null", b"{}"])
def test_run_config_that_is_not_a_json_object_is_refused(workdir, tmp_path, content):

    copy = copy_workdir(workdir, tmp_path)
    with open(os.path.join(copy, RUN_CONFIG), "wb") as f:
        f.write(content)
    with pytest.raises(WorkdirError, match=RUN_CONFIG):
        runner.open_workdir(copy)
