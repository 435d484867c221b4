"""distill.py, cli/distill.py and translate/distillation.py on one tiny trained number-task workdir.

The distilled corpus is checked against the run's own splits (one target per training
example, in order; gold validation and test targets) and against decoding every training
source directly; a 2-step train.py run reads it with the printed flags, and distilling
that run exercises a parallel_text teacher through the command line.
"""

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_config

from flaxformer_lite import datasets
from flaxformer_lite.cli import distill
from flaxformer_lite.config import run as run_config_lib
from flaxformer_lite.config import sections
from flaxformer_lite.config.dataset_options import ParallelText
from flaxformer_lite.config.run import parse
from flaxformer_lite.data import examples
from flaxformer_lite.models import from_config
from flaxformer_lite.training.workdir import RUN_CONFIG, WorkdirError, load_run_config
from flaxformer_lite.translate import distillation, input_lines, line_io, runner

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
BEAM = dict(beam_size=2, alpha=0.6)


def run_script(script, *args):
    return subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, env=ENV, capture_output=True, timeout=300
    )


def read(path):
    return line_io.read_lines(str(path))[0]


def data_splits(workdir):
    return datasets.load_splits(load_run_config(workdir).data)


@pytest.fixture(scope="module")
def workdir(tfds_dir, tmp_path_factory):
    from flaxformer_lite.training import loop

    config = tiny_config(tfds_dir, num_steps=30)
    config.data.number_words.shape_balance = 0.7  # repeats rarer shapes: training sources recur
    path = str(tmp_path_factory.mktemp("distill") / "run")
    loop.train_and_evaluate(parse(config), path, log=lambda s: None)
    return path


@pytest.fixture(scope="module")
def splits(workdir):
    return data_splits(workdir)


@pytest.fixture(scope="module")
def distilled(workdir, tmp_path_factory):
    """The corpus, its manifest, the run's log, and the lines each decode_lines call got."""
    out = tmp_path_factory.mktemp("corpus") / "kd"
    calls, messages = [], []
    decode_lines = runner.decode_lines

    def counting(model, params, tokenizer, run_config, lines, **kw):
        calls.append(list(lines.ids))
        return decode_lines(model, params, tokenizer, run_config, lines, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "decode_lines", counting)
        options = distill.Options(workdir=workdir, output_dir=str(out), batch_size=16, **BEAM)
        manifest = distill.run(options, log=messages.append)
    return out, manifest, messages, calls


@pytest.fixture(scope="module")
def loaded(workdir):
    from flaxformer_lite.training import restore

    run_config, tokenizer = runner.open_workdir(workdir)
    params, _ = restore.restore_params(workdir)
    return from_config.build_model(run_config), params, tokenizer, run_config


# ----------------------------------------------------------------------------
# The corpus.
# ----------------------------------------------------------------------------


def test_one_target_per_training_example_in_order(distilled, splits):
    out, manifest, messages, _ = distilled
    sources = examples.texts(splits["train"], "source")
    names = [f"{split}.{lang}" for split in ("train", "val", "test") for lang in ("src", "tgt")]
    assert sorted(os.listdir(out)) == sorted(["distill.json", *names])
    assert read(out / "train.src") == sources
    assert len(read(out / "train.tgt")) == len(sources)
    assert json.loads((out / "distill.json").read_text()) == manifest
    assert manifest["num_train_lines"] == len(sources)
    assert manifest["split_lines"] == {"train": len(sources), "val": 20, "test": 20}
    assert manifest["step"] == 30 and manifest["beam_size"] == 2 and manifest["alpha"] == 0.6
    assert manifest["workdir"] == os.path.abspath(manifest["workdir"])
    assert messages[-1].startswith(f"distilled {len(sources)} training line(s)")


def test_each_distinct_source_is_decoded_once(distilled, splits, loaded):
    _, manifest, _, calls = distilled
    _, _, tokenizer, run_config = loaded
    sources = examples.texts(splits["train"], "source")
    distinct = list(dict.fromkeys(sources))
    assert len(distinct) < len(sources)  # the shape balance repeats pairs
    assert manifest["num_distinct_sources"] == len(distinct)
    want = input_lines.tokenize_lines(tokenizer, distinct, run_config.data.max_source_len)
    assert calls == [want.ids]


def test_targets_equal_decoding_every_training_source(distilled, splits, loaded):
    # Two ways to the same lines: each distinct source once, batches of 16, mapped back; and
    # every training line in batches of 7, as decode.py would decode the file train.src.
    out, manifest, _, _ = distilled
    model, params, tokenizer, run_config = loaded
    sources = examples.texts(splits["train"], "source")
    search = runner.make_search(run_config, **BEAM)
    result = runner.decode_lines(
        model, params, tokenizer, run_config, sources, search=search, batch_size=7
    )
    targets = [line_io.format_line(h) for h in result.hypotheses]
    assert read(out / "train.tgt") == targets
    gold = examples.texts(splits["train"], "target")
    changed = sum(t != g for t, g in zip(targets, gold))
    assert manifest["num_changed_targets"] == changed
    assert manifest["changed_fraction"] == pytest.approx(changed / len(sources))
    assert manifest["num_empty_targets"] == targets.count("")


def test_validation_and_test_keep_their_gold_targets(distilled, splits):
    out = distilled[0]
    for split, name in (("validation", "val"), ("test", "test")):
        assert read(out / f"{name}.src") == examples.texts(splits[split], "source")
        assert read(out / f"{name}.tgt") == examples.texts(splits[split], "target")


def test_blank_sources_stay_blank_and_repeats_share_one_decode(loaded):
    model, params, tokenizer, run_config = loaded
    search = runner.make_search(run_config, **BEAM)
    lines = ["", "en 5", "   ", "en 5", "de 12"]
    got = distillation.distill_targets(
        model, params, tokenizer, run_config, lines, search=search, log=lambda s: None
    )
    assert got.num_distinct == 4
    assert got.targets[0] == got.targets[2] == ""
    assert got.targets[1] == got.targets[3]
    assert len(got.result.hypotheses) == 4


# ----------------------------------------------------------------------------
# Writing and refusing.
# ----------------------------------------------------------------------------


def test_corpus_lines_stay_one_line_each(tmp_path):
    lines = ["a\tb", "x\ny", "", "r\r\ns", "end\r"]
    distillation.write_corpus(str(tmp_path / "c"), {"train.src": lines}, {"n": 1})
    assert read(tmp_path / "c" / "train.src") == ["a\tb", "x y", "", "r s", "end "]
    assert json.loads((tmp_path / "c" / "distill.json").read_text()) == {"n": 1}


def test_write_corpus_fills_an_empty_directory_with_readable_files(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    distillation.write_corpus(str(out), {"train.src": ["a"]}, {})
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "train.src").st_mode & 0o777 == 0o666 & ~umask
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask


def test_interrupted_write_leaves_no_corpus(tmp_path, monkeypatch):
    written = []

    def failing(path, data):
        if written:
            raise KeyboardInterrupt
        written.append(path)

    monkeypatch.setattr(distillation, "atomic_write", failing)
    with pytest.raises(KeyboardInterrupt):
        distillation.write_corpus(str(tmp_path / "c"), {"train.src": ["a"], "train.tgt": ["b"]}, {})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["file", "full"])
def test_write_corpus_refuses_existing_data(tmp_path, kind):
    out = tmp_path / "c"
    if kind == "file":
        out.write_text("keep\n")
    else:
        out.mkdir()
        (out / "train.src").write_text("keep\n")
    with pytest.raises(line_io.InputError, match="pass a new"):
        distillation.write_corpus(str(out), {"train.src": ["new"]}, {})
    kept = out if kind == "file" else out / "train.src"
    assert kept.read_text() == "keep\n"
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_cli_refuses_a_non_empty_output_dir(workdir, tmp_path):
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "train.src").write_bytes(b"mine\n")
    result = run_script("distill.py", "--workdir", workdir, "--output_dir", str(out))
    assert result.returncode == 2
    assert result.stderr.decode().splitlines() == [
        f"error: --output_dir {str(out)!r} is not empty; pass a new directory "
        "(an existing corpus is never overwritten)"
    ]
    assert os.listdir(out) == ["train.src"] and (out / "train.src").read_bytes() == b"mine\n"


def test_missing_workdir_or_checkpoint_is_refused_before_writing(workdir, tmp_path):
    out = str(tmp_path / "corpus")
    with pytest.raises(WorkdirError, match="does not exist"):
        distill.run(distill.Options(workdir=str(tmp_path / "nope"), output_dir=out))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(os.path.join(workdir, RUN_CONFIG), empty)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        distill.run(distill.Options(workdir=str(empty), output_dir=out))
    assert sorted(os.listdir(tmp_path)) == ["empty"]


# ----------------------------------------------------------------------------
# Flags and training on the corpus.
# ----------------------------------------------------------------------------


def test_languages_and_flags():
    data = sections.DataConfig(dataset="parallel_text", source_lang="en", target_lang="de")
    assert distillation.languages(data) == ("en", "de")
    assert distillation.languages(sections.DataConfig()) == ("src", "tgt")
    flags = distillation.train_flags("/c d/kd", ("en", "de"), {"validation": "val"})
    assert flags[-1] == "--config.data.split_names={'validation': 'val'}"
    assert shlex.split(distillation.shell_line(flags)) == flags


def test_the_printed_flags_load_the_corpus(distilled, tfds_dir):
    """The fast check of the slow end-to-end test below: the flags, applied to the data
    section, make training read the distilled pairs and the gold test split."""
    import ast

    out, manifest, _, _ = distilled
    config = tiny_config(tfds_dir)
    for flag in manifest["train_flags"]:
        name, value = flag.removeprefix("--config.data.").split("=", 1)
        with contextlib.suppress(ValueError, SyntaxError):  # else a plain string
            value = ast.literal_eval(value)
        *path, name = name.split(".")  # parallel_text.corpus_dir
        section = config.data
        for part in path:
            section = section[part]
        section[name] = value
    splits = datasets.load_splits(run_config_lib.parse(config).data)
    pairs = [p for p in zip(read(out / "train.src"), read(out / "train.tgt")) if all(p)]
    assert examples.texts(splits["train"], "target") == [t for _, t in pairs]
    assert examples.texts(splits["test"], "target") == read(out / "test.tgt")


@pytest.mark.slow
def test_train_py_trains_on_the_printed_flags(distilled, tfds_dir, tmp_path):
    out, manifest, _, _ = distilled
    student = str(tmp_path / "student")
    flags = shlex.split(distillation.shell_line(manifest["train_flags"]))
    result = run_script(
        *("train.py", "--config", "configs/tiny.py", "--workdir", student, *flags),
        *(f"--config.data.tfds_dir={tfds_dir}", "--config.train.num_steps=2"),
        "--config.train.tensorboard=False",
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    data = load_run_config(student).data
    assert (data.dataset, data.parallel_text.corpus_dir) == ("parallel_text", str(out))
    splits = data_splits(student)
    pairs = [p for p in zip(read(out / "train.src"), read(out / "train.tgt")) if all(p)]
    assert examples.texts(splits["train"], "target") == [t for _, t in pairs]
    assert examples.texts(splits["test"], "target") == read(out / "test.tgt")

    # The student is a parallel_text run: distill it through the command line.
    again = tmp_path / "again"
    result = run_script(
        *("distill.py", "--workdir", student, "--output_dir", str(again), "--beam_size", "1")
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    manifest2 = json.loads((again / "distill.json").read_text())
    assert result.stdout.decode() == distillation.shell_line(manifest2["train_flags"]) + "\n"
    assert f"distilled {len(pairs)} training line(s)" in result.stderr.decode()
    assert manifest2["dataset"] == "parallel_text" and manifest2["step"] == 2
    assert read(again / "train.src") == [s for s, _ in pairs]
    assert read(again / "val.tgt") == read(out / "val.tgt")


def test_a_relative_corpus_dir_names_where_to_run(workdir, monkeypatch, tmp_path):
    run_config = load_run_config(workdir)
    data = dataclasses.replace(
        run_config.data,
        dataset="parallel_text",
        parallel_text=ParallelText(corpus_dir="corpora/m30k"),
        source_lang="en",
        target_lang="de",
    )
    run_config = dataclasses.replace(run_config, data=data)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(line_io.InputError, match="run distill.py from the directory train.py ran"):
        distillation.teacher_data(run_config)
    (tmp_path / "corpora" / "m30k").mkdir(parents=True)
    assert distillation.teacher_data(run_config).parallel_text.corpus_dir == "corpora/m30k"
