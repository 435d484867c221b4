"""decode.py and decode_lib on one tiny trained checkpoint: alignment, bucketing, bad input."""

import os
import subprocess
import sys

import jax
import pytest
from conftest import ROOT, run_decode, tiny_config

from flaxformer_lite.cli import decode as decode_cli
from flaxformer_lite.config.run import parse
from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.translate import bucketing, line_io, reports, runner

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Normal lines, a blank line, CRLF, an over-long line, invalid UTF-8, no final newline.
MIXED = b"en 12\n\nde 45\r\nen " + b"1" * 200 + b"\nde \xff\xfe 3\n   \nen 7"


@pytest.fixture(scope="module")
def workdir(trained_tiny):
    """The shared tiny run: 60 steps, checkpoints 20 to 60 (read, never written)."""
    return trained_tiny


@pytest.fixture(scope="module")
def loaded(workdir):
    from flaxformer_lite.training import load_state

    run_config, tokenizer = runner.open_workdir(workdir)
    model, state, _, _ = load_state.restore_trained(workdir)
    return model, state.params, tokenizer, run_config


def greedy(run_config, **kw):
    return runner.make_search(run_config, beam_size=1, **kw)


# ----------------------------------------------------------------------------
# Pure helpers.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, lines, invalid",
    [
        (b"", [], 0),
        (b"\n", [""], 0),
        (b"a\n", ["a"], 0),
        (b"a", ["a"], 0),
        (b"a\r\nb\r\n", ["a", "b"], 0),
        (b"a\n\n", ["a", ""], 0),
        (b"\xef\xbb\xbfa\n\xffb\n", ["a", "\ufffdb"], 1),
    ],
)
def test_read_lines(tmp_path, data, lines, invalid):
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    assert line_io.read_lines(str(path)) == (lines, invalid)


def test_buckets_and_batch_plan():
    assert bucketing.bucket_lengths(10) == (8, 10)
    assert bucketing.bucket_lengths(256) == (8, 16, 32, 64, 128, 256)
    assert bucketing.bucket_lengths(100) == (8, 16, 32, 64, 100)
    assert bucketing.bucket_lengths(5) == (5,)
    plan = bucketing.plan_batches([3, 0, 9, 5, 12, 1], 2, (8, 16))
    assert plan == [([4, 2], 16), ([3, 0], 8), ([5], 8)]  # the empty line 1 is not decoded


def test_format_line_keeps_one_line_per_input():
    assert line_io.format_line([("a\nb\tc\r", -1.0)]) == "a b c "
    line = line_io.format_line([("x\ty", -0.5), ("z", -1.25)], nbest=2)
    assert line == "x y\t-0.5000\tz\t-1.2500"
    assert line_io.format_line([], nbest=3) == ""


def test_make_search_methods_and_errors():
    rc = parse(tiny_config("/nonexistent"))
    assert (rc.data.max_target_len, rc.model.positions) == (16, "sinusoidal")
    assert runner.make_search(rc).method == "beam"
    assert runner.make_search(rc, beam_size=1).method == "greedy"
    sample = runner.make_search(rc, temperature=0.7, top_k=5)
    assert (sample.method, sample.temperature, sample.max_len) == ("sample", 0.7, 16)
    for kw in (
        dict(nbest=2, beam_size=1),
        dict(nbest=5, beam_size=4),
        dict(nbest=2, temperature=1.0),
        dict(top_p=0.9),
        dict(min_len=16),
    ):
        with pytest.raises(line_io.InputError):
            runner.make_search(rc, **kw)


def test_bleu_report_has_signature_and_checks_counts():
    report = reports.bleu_report(["forty-two", "zwei"], ["forty-two", "drei"])
    assert "BLEU|nrefs:1|" in report and "chrF2|nrefs:1|" in report
    with pytest.raises(line_io.InputError, match="1 lines but the input has 2"):
        reports.bleu_report(["a", "b"], ["a"])


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(bleu_lang="de"), "with --reference: add it"),
        (dict(bleu_lowercase=False), "with --reference: add it"),
        (dict(bleu_lang="de", reference="ref.txt", score=True), "--score computes none"),
    ],
)
def test_bleu_flags_need_decoding_with_a_reference(tmp_path, changes, words):
    if "reference" in changes:
        (tmp_path / "ref.txt").write_text("a\n")
        changes["reference"] = str(tmp_path / "ref.txt")
    options = decode_cli.Options(workdir=str(tmp_path / "missing"), **changes)
    with pytest.raises(line_io.InputError, match=words):
        decode_cli.run(options)  # refused before the workdir is opened


# ----------------------------------------------------------------------------
# In-process decoding on the trained checkpoint.
# ----------------------------------------------------------------------------


def test_mixed_input_gives_one_result_per_line(loaded, tmp_path):
    model, params, tokenizer, run_config = loaded
    path = tmp_path / "mixed.txt"
    path.write_bytes(MIXED)
    lines, invalid = line_io.read_lines(str(path))
    assert len(lines) == 7 and invalid == 1
    result = runner.decode_lines(
        model, params, tokenizer, run_config, lines, search=greedy(run_config), batch_size=4
    )
    assert len(result.hypotheses) == len(lines)
    assert result.texts[1] == result.texts[5] == ""  # blank lines are passed through
    assert all(result.hypotheses[i] for i in (0, 2, 3, 4, 6))
    assert result.sources.num_empty == 2 and result.sources.num_truncated == 1
    assert result.sources.num_unknown >= 1  # U+FFFD is not in the vocabulary
    assert len(result.sources.ids[3]) == run_config.data.max_source_len
    assert result.sources.ids[3][-1] == EOS_ID
    with pytest.raises(line_io.InputError, match=r"\(line 4\)"):
        runner.decode_lines(
            model, params, tokenizer, run_config, lines, search=greedy(run_config), strict=True
        )


def test_order_preserved_and_compilations_bounded(loaded, no_compilation_cache):
    model, params, tokenizer, run_config = loaded
    # 1 to 7 digits: source lengths on both sides of the 8-token bucket.
    lines = [f"{'en' if i % 2 else 'de'} {str(7 * i + 1) * (1 + i % 7)}"[:10] for i in range(21)]
    # A max_len no other test uses, so every compilation of this search happens here.
    search = greedy(run_config, max_len=12)
    # Backend compilations of the jitted `runner.predict_batch`, counted through jax's
    # public monitoring events (one per compiled shape).
    compiled = []

    def listener(event, seconds, **kw):
        if (
            event == BACKEND_COMPILE_EVENT
            and kw.get("fun_name") == f"jit({runner.predict_batch.__name__})"
        ):
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        together = runner.decode_lines(
            model, params, tokenizer, run_config, lines, search=search, batch_size=4
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    buckets = bucketing.bucket_lengths(run_config.data.max_source_len)
    assert {length for _, length in together.batch_shapes} == set(buckets)
    assert len(together.batch_shapes) <= len(buckets)
    # Exactly one compilation per distinct batch shape: none wasted, and the count
    # is really measured (a listener that saw nothing fails here).
    assert len(compiled) == len(together.batch_shapes), compiled
    alone = [
        runner.decode_lines(model, params, tokenizer, run_config, [line], search=search)
        for line in lines
    ]
    assert together.texts == [r.texts[0] for r in alone]


def test_checkpoint_averaging_is_the_mean_of_the_checkpoints(workdir):
    import jax
    import numpy as np

    from flaxformer_lite.training import checkpoints, load_state

    ckpt = checkpoints.Checkpointer(workdir, keep=100, save_every=0)
    steps = ckpt.all_steps()[-3:]
    ckpt.close()
    states = [load_state.restore_trained(workdir, s)[1] for s in steps]
    _, averaged, _, _ = load_state.restore_trained(workdir, average=3)
    assert int(averaged.step) == steps[-1]
    for leaf, *each in zip(*(jax.tree.leaves(s.params) for s in (averaged, *states))):
        np.testing.assert_allclose(leaf, sum(np.asarray(x) for x in each) / 3, rtol=1e-6)
    # Everything but the parameters is the last checkpoint's.
    for a, b in zip(jax.tree.leaves(averaged.opt_state), jax.tree.leaves(states[-1].opt_state)):
        np.testing.assert_array_equal(a, b)
    _, earlier, _, _ = load_state.restore_trained(workdir, steps[-2], average=2)
    for leaf, a, b in zip(*(jax.tree.leaves(s.params) for s in (earlier, *states[:2]))):
        np.testing.assert_allclose(leaf, (np.asarray(a) + np.asarray(b)) / 2, rtol=1e-6)


# ----------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------


def test_cli_nbest_reference_attention(workdir, tmp_path):
    src, ref, out, plots = (tmp_path / n for n in ("in.txt", "ref.txt", "out.txt", "plots"))
    src.write_bytes(MIXED)
    ref.write_text("twelve\n\nfünfundvierzig\neleven\ndrei\n\nseven\n", encoding="utf-8")
    result = run_decode(
        *("--workdir", workdir, "--input", str(src), "--output", str(out)),
        *("--nbest", "3", "--beam_size", "3", "--reference", str(ref)),
        *("--attention_png", str(plots), "--attention_count", "2"),
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-3000:]
    assert result.stdout == b""
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines.pop() == "" and len(lines) == 7  # one line per input, newline-terminated
    for i, line in enumerate(lines):
        if i in (1, 5):
            assert line == ""
            continue
        fields = line.split("\t")
        assert len(fields) == 6, line
        scores = [float(s) for s in fields[1::2]]
        assert scores == sorted(scores, reverse=True)
    assert "1 line(s) had invalid UTF-8" in stderr
    assert "1 line(s) longer than 10 source tokens were truncated" in stderr
    assert "unknown to the vocabulary" in stderr
    bleu = [x for x in stderr.splitlines() if x.startswith("BLEU")]
    assert len(bleu) == 1 and "nrefs:1" in bleu[0]
    assert any(x.startswith("chrF") for x in stderr.splitlines())
    # The tokenized BLEU4 of the 1-best outputs as written, recomputed here; configs/tiny.py
    # names no target language, so English rules are assumed and the line says so.
    (tokenized,) = [x for x in stderr.splitlines() if x.startswith("tokenized BLEU4 = ")]
    hyps = [line.split("\t")[0] for line in lines]
    refs, _ = line_io.read_lines(str(ref))
    note = " (lang en assumed: the run config names no data.target_lang; set --bleu_lang)"
    assert tokenized == reports.tokenized_bleu_line(hyps, refs, "en", note=note)
    assert "| BLEU4 on lowercased Moses-tokenized text (sacremoses " in tokenized
    pngs = sorted(os.listdir(plots))
    assert pngs == ["attention_0000.png", "attention_0002.png"]  # line 1 is blank
    for name in pngs:
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "case, words",
    [
        ("strict", "exceed the model's 10 source tokens (line 4)"),
        ("missing", "does not exist; run train.py"),
        ("average", "averaging 50 checkpoints needs 50 up to step 60"),
        ("empty", None),
    ],
)
def test_cli_bad_input_one_line(workdir, tmp_path, case, words):
    out = tmp_path / "out.txt"
    if case == "strict":
        args, stdin = ("--workdir", workdir, "--strict"), MIXED
    elif case == "missing":
        args, stdin = ("--workdir", str(tmp_path / "nope")), b"en 1\n"
    elif case == "average":
        args, stdin = ("--workdir", workdir, "--average", "50"), b"en 1\n"
    else:
        args, stdin = ("--workdir", workdir, "--output", str(out)), b""
    result = run_decode(*args, stdin=stdin)
    err = result.stderr.decode().strip().splitlines()
    if words is None:
        assert result.returncode == 0, err
        assert err == ["input is empty: nothing to decode"]
        assert out.read_bytes() == b"" and result.stdout == b""
        return
    assert result.returncode == 2
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert result.stdout == b"" and not out.exists()


def test_cli_reads_a_relative_workdir(workdir):
    parent, name = os.path.split(workdir)
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "decode.py"), "--workdir", name, "--beam_size", "1"],
        cwd=parent,
        env=ENV,
        input=b"de 7\n",
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert len(out.stdout.decode().splitlines()) == 1


def test_cli_report_prints_the_exposure_table(workdir, tmp_path):
    src, ref, out = tmp_path / "in.txt", tmp_path / "ref.txt", tmp_path / "out.txt"
    src.write_text("en 12\n\nde 45\nen 7\n")
    ref.write_text("twelve\n\nfünfundvierzig\nseven\n", encoding="utf-8")
    result = run_decode(
        *("--workdir", workdir, "--input", str(src), "--output", str(out)),
        *("--reference", str(ref), "--report"),  # greedy: --beam_size defaults to 1
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-3000:]
    assert len(out.read_text(encoding="utf-8").split("\n")) == 4 + 1  # one line per input
    lines = stderr.splitlines()
    start = lines.index("exposure bias over 3 example(s), greedy decoding vs the references")
    assert lines[start + 1].startswith("token accuracy  teacher-forced")
    assert lines[start + 3].split()[:4] == ["prefix", "swap", "k", "gold"]
    assert any(x.startswith("BLEU") for x in lines)  # decoding's own report is kept
    refused = run_decode(
        *("--workdir", workdir, "--input", str(src), "--reference", str(ref)),
        *("--report", "--beam_size", "4"),  # asked for explicitly: a contradiction
    )
    err = refused.stderr.decode().strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("error: --report always decodes greedily") and "--beam_size" in err[0]
