"""decode.py --score: forced decoding of references on a tiny trained workdir."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.models import from_config
from flaxformer_lite.translate import line_io, scoring

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
SOURCES = ["en 12", "", "de 45", "en 7", "de 3"]
REFERENCES = ["twelve", "zero", "fünfundvierzig", "", "drei"]  # line 4: an empty reference


def run_decode(*args):
    return subprocess.run(
        [sys.executable, "decode.py", *args], cwd=ROOT, env=ENV, capture_output=True, timeout=300
    )


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def workdir(trained_tiny):
    """The shared tiny run, trained for 60 steps (read, never written)."""
    return trained_tiny


def test_pair_batches_share_shapes():
    # Sorted by (source bucket, target length), largest first; line 1 has no source.
    plan = scoring.plan_pair_batches([3, 0, 9, 5, 12, 1], [4, 2, 2, 9, 3, 20], 2, (8, 16), (8, 24))
    assert plan == [([4, 2], 16, 8), ([5, 3], 8, 24), ([0], 8, 8)]


def test_tokenize_targets_ends_in_eos_and_truncates():
    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    eos = EOS_ID
    targets = scoring.tokenize_targets(Chars(), ["ab", "", "abcdef"], 4)
    assert targets.ids == [[97, 98, eos], [eos], [97, 98, 99, eos]]
    assert targets.num_truncated == 1
    with pytest.raises(line_io.InputError, match=r"\(line 3\)"):
        scoring.tokenize_targets(Chars(), ["ab", "", "abcdef"], 4, strict=True)


def test_cli_scores_one_line_per_input(workdir, tmp_path):
    src, ref = write(tmp_path / "src", SOURCES), write(tmp_path / "ref", REFERENCES)
    result = run_decode("--workdir", workdir, "--input", src, "--reference", ref, "--score")
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    lines = result.stdout.decode().split("\n")
    assert lines.pop() == "" and len(lines) == len(SOURCES)
    assert lines[1] == ""  # an empty source is not scored
    scores = [float(lines[i]) for i in (0, 2, 3, 4)]
    assert all(s <= 0 for s in scores)

    out = str(tmp_path / "out")
    args = ("--workdir", workdir, "--input", src, "--reference", ref, "--output", out)
    result = run_decode(*args, "--score", "--score_tokens", "--batch_size", "2")
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    with open(out, encoding="utf-8") as f:
        rows = f.read().split("\n")[:-1]
    assert len(rows) == len(SOURCES) and rows[1] == ""
    for i in (0, 2, 3, 4):
        sequence, *tokens = map(float, rows[i].split("\t"))
        assert sequence == pytest.approx(float(lines[i]), abs=1e-5)  # batching changes nothing
        assert all(t <= 0 for t in tokens) and sum(tokens) == pytest.approx(sequence, abs=1e-4)
    assert len(rows[3].split("\t")) == 2  # an empty reference scores EOS alone


def test_score_is_beam_search_logprob_without_length_penalty(workdir, tmp_path):
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import runner

    params, run_config = restore.restore_params(workdir)
    _, vocab = runner.open_workdir(workdir)
    model = from_config.build_model(run_config)
    sources = [f"{'en' if i % 2 else 'de'} {7 * i + 3}" for i in range(12)]
    search = runner.make_search(run_config, beam_size=4, alpha=0.0)
    decoded = runner.decode_lines(model, params, vocab, run_config, sources, search=search)
    # Only hypotheses that stopped with EOS and re-tokenize to the same ids can be compared.
    kept = [
        i
        for i, ids in enumerate(decoded.output_ids)
        if ids and ids[-1] == EOS_ID and vocab.target.encode(decoded.texts[i]) == ids[:-1]
    ]
    assert len(kept) >= len(sources) // 2
    src = write(tmp_path / "src", [sources[i] for i in kept])
    ref = write(tmp_path / "ref", [decoded.texts[i] for i in kept])
    result = run_decode("--workdir", workdir, "--input", src, "--reference", ref, "--score")
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    got = [float(x) for x in result.stdout.decode().split()]
    want = [decoded.hypotheses[i][0][1] for i in kept]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "extra, words",
    [
        ((), "--reference has 2 lines but the input has 3"),
        (("--score_tokens",), "--reference has 2 lines but the input has 3"),
        (("--no_reference",), "--score needs --reference"),
    ],
)
def test_cli_errors_are_one_line(workdir, tmp_path, extra, words):
    src, ref = write(tmp_path / "src", SOURCES[:3]), write(tmp_path / "ref", REFERENCES[:2])
    args = ["--workdir", workdir, "--input", src, "--score"]
    if "--no_reference" not in extra:
        args += ["--reference", ref, *extra]
    result = run_decode(*args)
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert result.stdout == b""
