"""Run configs: every field checked up front, the resume check, and every config file trains."""

import dataclasses
import glob
import os
import random
import subprocess
import sys

import ml_collections
import pytest
from conftest import ROOT

from configs import default
from flaxformer_lite.config import ConfigError, sections
from flaxformer_lite.config import run as run_config
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.training import checkpoint_format, load_state
from flaxformer_lite.training.state import param_shapes
from flaxformer_lite.training.workdir import CHECKPOINT_DIR, WorkdirError, claim_workdir

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def with_changes(changes: dict, base=default.get_config):
    config = base()
    for key, value in changes.items():
        *path, name = key.split(".")
        section = config
        for part in path:
            section = section[part]
        if name in section:
            del section[name]  # ConfigDict keeps a field's type; a wrong one is the test
        section[name] = value
    return config


def check_refused(changes: dict, words: str, base=default.get_config):
    with pytest.raises(ConfigError) as e:
        run_config.validate(with_changes(changes, base))
    message = str(e.value)
    assert "\n" not in message and words in message, message


ENUMS = [
    ("data.batching", sections.BATCHINGS),
    ("data.vocab_model_type", sections.VOCAB_MODEL_TYPES),
    ("train.eval_search", sections.EVAL_SEARCHES),
    ("optim.schedule", sections.SCHEDULES),
    ("model.positions", ("sinusoidal", "learned", "none")),
    ("model.norm", ("post", "pre")),
    ("model.activation", ("relu", "gelu")),
    ("model.attention_impl", ("auto", "vmap", "fast")),  # cudnn, splash: a GPU, a TPU
    ("optim.state_dtype", sections.STATE_DTYPES),
    ("model.dropout_rng", ("hash", "threefry")),
]


@pytest.mark.parametrize("flag, choices", ENUMS)
def test_every_enumerated_value(flag, choices):
    for choice in choices:
        run_config.validate(with_changes({flag: choice}))
    check_refused({flag: "beem"}, f"{flag}='beem' is not one of {', '.join(choices)}")


def test_a_kernel_or_dtype_this_platform_lacks_is_refused():
    for kernel, device in (("cudnn", "GPU"), ("splash", "TPU")):
        check_refused(
            {"model.attention_impl": kernel},
            f"model.attention_impl={kernel!r} needs a {device}, but JAX runs on cpu; use "
            "model.attention_impl='auto'",
        )
    check_refused({"model.dtype": "float8"}, "model.dtype='float8' is not a dtype name; use one")
    check_refused({"model.param_dtype": "auto"}, "model.param_dtype='auto' is not a dtype name")


@pytest.mark.parametrize(
    "flag, bad, words",
    [
        ("train.batch_size", 0, "train.batch_size must be a positive integer, got 0"),
        ("train.eval_batch_size", -1, "must be a positive integer"),
        ("train.num_steps", 2.5, "train.num_steps must be a positive integer"),
        ("train.log_every", 0, "train.log_every must be a positive integer"),
        ("train.grad_accum_steps", 0, "train.grad_accum_steps must be a positive integer"),
        ("train.grad_accum_steps", 3, "train.grad_accum_steps=3 must divide train.batch_size"),
        ("train.label_smoothing", 1.0, "train.label_smoothing must be a number in [0, 1)"),
        ("train.label_smoothing", -0.1, "train.label_smoothing must be a number in [0, 1)"),
        ("train.eval_every", -1, "train.eval_every must be a non-negative integer"),
        ("train.eval_max_batches", -1, "train.eval_max_batches must be a non-negative"),
        ("train.eval_beam_size", 0, "train.eval_beam_size must be a positive integer"),
        ("train.eval_alpha", -0.5, "train.eval_alpha must be a number in [0, inf)"),
        ("train.checkpoint_every", -5, "train.checkpoint_every must be a non-negative"),
        ("train.keep_checkpoints", 0, "train.keep_checkpoints must be a positive integer"),
        ("train.num_examples_to_print", -1, "train.num_examples_to_print must be a non-neg"),
        ("train.eval_bleu", "yes", "train.eval_bleu must be True or False"),
        ("train.exposure_report", 1, "train.exposure_report must be True or False"),
        ("train.progress_bar", 1, "train.progress_bar must be True or False"),
        ("train.seed", -1, "train.seed must be a non-negative integer"),
        ("train.bach_size", 8, "train.bach_size is not a train field"),
        ("optim.learning_rate", 0.0, "optim.learning_rate must be a number in (0, inf)"),
        ("optim.warmup_steps", -1, "optim.warmup_steps must be a non-negative integer"),
        ("optim.b1", 1.0, "optim.b1 must be a number in [0, 1)"),
        ("optim.b2", -0.1, "optim.b2 must be a number in [0, 1)"),
        ("optim.eps", 0.0, "optim.eps must be a number in (0, inf)"),
        ("optim.weight_decay", -1e-4, "optim.weight_decay must be a number in [0, inf)"),
        ("optim.grad_clip_norm", -1.0, "optim.grad_clip_norm must be a number in [0, inf)"),
        ("mesh.fsdp", 0, "mesh.fsdp must be a positive integer"),
        ("mesh.model", 1.5, "mesh.model must be a positive integer"),
        ("data.vocab_size", 1, "data.vocab_size must be an integer >= 2"),
        ("data.max_source_len", 1, "data.max_source_len must be an integer >= 2"),
        ("data.max_target_len", 0, "data.max_target_len must be an integer >= 2"),
        ("data.max_tokens", -1, "data.max_tokens must be a non-negative integer"),
        ("data.target_vocab_size", 1, "data.target_vocab_size must be 0"),
        ("data.target_vocab_size", 300, "needs separate vocabularies"),
        ("data.shared_vocab", "no", "data.shared_vocab must be True or False"),
        ("data.shared_vocab", False, "cannot share one embedding table"),
        ("data.valid_fraction", 1.0, "data.valid_fraction must be a number in [0, 1)"),
        ("data.test_fraction", -0.1, "data.test_fraction must be a number in [0, 1)"),
        ("data.valid_fraction", 0.96, "leave no training examples"),
        (
            "data.number_words.max_number",
            -1,
            "data.number_words.max_number must be a non-negative integer",
        ),
        (
            "data.number_words.max_number",
            99,
            "data.number_words.always_train_below=100 keeps every number up to",
        ),
        (
            "data.number_words.shape_balance",
            1.5,
            "data.number_words.shape_balance must be a number in [0, 1]",
        ),
        (
            "data.number_words.languages",
            (),
            "data.number_words.languages must be a non-empty tuple of strings",
        ),
        (
            "data.number_words.languages",
            ("en", "xx"),
            "data.number_words.languages has 'xx', which num2words cannot",
        ),
        ("data.names.valid", -1, "data.names.valid must be a non-negative integer"),
        ("data.spoken_numbers.num_mels", 0, "data.spoken_numbers.num_mels must be a positive"),
        ("data.tsv.path", 3, "data.tsv.path must be a string, got 3"),
        ("data.tsv.colum", 3, "data.tsv.colum is not a data.tsv field; the fields are path,"),
        ("data.tsv", "pairs.tsv", "data.tsv is a section of fields, got 'pairs.tsv'"),
        ("data.names_train", 5, "data.names_train is now data.names.train"),
        ("data.num_mels", 40, "data.num_mels is now data.spoken_numbers.num_mels"),
        ("data.split_names", {"dev": "val"}, "data.split_names has key 'dev'"),
        ("data.dataset", "", "data.dataset is empty"),
        ("model.dropout_rate", 1.0, "model.dropout_rate must be in [0, 1)"),
        ("model.d_model", 30, "not divisible by model.num_heads"),
        ("model.num_layers", 2, "unknown model config key(s) num_layers"),
    ],
)
def test_every_range(flag, bad, words):
    check_refused({flag: bad}, words)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"data.dataset": "parallel_text"}, "data.parallel_text.corpus_dir is empty"),
        (
            {"optim.schedule": "rsqrt", "optim.warmup_steps": 0},
            "optim.warmup_steps=0, but the rsqrt schedule",
        ),
        (
            {"data.dataset": "parallel_text", "data.parallel_text.corpus_dir": "c"},
            "data.source_lang is empty",
        ),
        (
            {"data.dataset": "wmt14_translate/de-en", "data.source_lang": "en"},
            "data.target_lang is empty",
        ),
        (
            {"data.dataset": "x/y", "data.source_lang": "en", "data.target_lang": "en"},
            "both 'en'",
        ),
        ({"data.dataset": "tsv"}, "data.tsv.path is empty"),
        (
            {"data.dataset": "tsv", "data.tsv.path": "p", "data.tsv.target_column": 0},
            "data.tsv.source_column and data.tsv.target_column are both 0",
        ),
        (
            {"data.dataset": "tsv", "data.tsv.path": "p", "data.tsv.source_column": -1},
            "data.tsv.source_column must be a non-negative integer",
        ),
        ({"model.positions": "learned", "model.max_len": 12}, "model.max_len=12 is shorter"),
        ({"train.best_metric": "bleu_tok"}, "computed only with --config.train.eval_bleu=True"),
        (
            {"train.best_metric": "bleu_tok", "train.eval_bleu": True},
            "but data.target_lang is empty",
        ),
    ],
)
def test_dataset_fields_and_cross_checks(changes, words):
    check_refused(changes, words)


def test_typed_sections():
    config = default.get_config()
    run = run_config.parse(config)
    # Every field of every section carries the config's value, typed.
    for section in ("data", "train", "optim", "mesh"):
        for key, value in config[section].items():
            got = getattr(getattr(run, section), key)
            if isinstance(value, ml_collections.ConfigDict):
                value = value.to_dict()
                got = dataclasses.asdict(got) if dataclasses.is_dataclass(got) else dict(got)
            assert got == value or (isinstance(got, tuple) and list(got) == list(value)), (
                section,
                key,
                got,
                value,
            )
    assert run.model.vocab_size == run.data.vocab_size
    assert type(run.optim.weight_decay) is float and type(run.train.num_steps) is int
    config = default.get_config()
    del config.train["eval_alpha"]  # a missing field takes its default
    assert run_config.parse(config).train.eval_alpha == 0.6


# Every config's parameter count (vocabularies padded to model.vocab_multiple): a change of
# any of them changes what a shipped config trains, and must be made here on purpose.
PARAMETER_COUNTS = {
    "copy": 958849,
    "default": 958464,
    "multi30k_deen": 7595008,
    "multi30k_ende": 7595008,
    "multi30k_ende_copy": 7595777,
    "multi30k_ende_ctc": 7595008,  # multi30k_ende's: the CTC decoder adds no parameter
    "multi30k_ende_ctc_distilled": 7595008,
    "multi30k_ende_nat": 7660544,
    # 4 + 4 pre-LN layers, d 128, d_ff 256, 8000 pieces padded to 8064 rows: by hand,
    # 4 * 132480 + 4 * 198784 + 8064 * 128, plus the two stacks' final LayerNorms (2 * 256)
    "multi30k_ende_tiny": 2357760,
    "multi30k_ende_nat_distilled": 7660544,
    "names": 958464,
    "names_copy": 958849,
    "nat": 991232,
    "numbers_long": 958464,
    "spoken_numbers": 1836672,
    "tiny": 25472,
    "wmt14_ende_base": 63143936,
    "wmt14_ende_big": 214368256,
}


def _parameter_count(config) -> int:
    from flaxformer_lite.training import dry_run

    params = dry_run.abstract_params(run_config.parse(config))
    return sum(row[2] for row in dry_run.parameter_table(params))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_every_config_validates_and_builds_its_parameter_count(path):
    config = _load_config(path)
    run_config.validate(config)
    name = os.path.basename(path)[:-3]
    assert _parameter_count(config) == PARAMETER_COUNTS[name], name


def test_the_base_config_has_the_papers_parameter_count():
    """Counted by hand: 6 + 6 post-LN layers, d_model 512, d_ff 2048, biases everywhere, one
    shared embedding of 37000 entries padded to 37120 rows, no final LayerNorm."""
    d, f, v = 512, 2048, 37120
    attention = 4 * (d * d + d)
    ffn = d * f + f + f * d + d
    layer_norm = 2 * d
    encoder_layer = attention + ffn + 2 * layer_norm
    decoder_layer = 2 * attention + ffn + 3 * layer_norm
    want = 6 * encoder_layer + 6 * decoder_layer + v * d
    assert want == PARAMETER_COUNTS["wmt14_ende_base"]
    config = _load_config(os.path.join(ROOT, "configs", "wmt14_ende_base.py"))
    assert config.data.vocab_size == 37000 and config.model.vocab_multiple == 128


# Configs that change one thing of another config whose run is tested below, a thing trained
# end to end elsewhere: their runs are slow tests (their model builds in the test above).
VARIANTS = {
    "multi30k_deen": "multi30k_ende with the languages swapped",
    "nat": "default with a nat section (tests/unit/models/test_nat.py trains one)",
    "multi30k_ende_nat": "multi30k_ende with a nat section",
    "multi30k_ende_nat_distilled": "multi30k_ende_nat on another corpus directory",
    "multi30k_ende_tiny": "multi30k_ende at another size and learning rate",
    "multi30k_ende_ctc": "multi30k_ende with a ctc nat section (test_ctc_nat.py trains one)",
    "multi30k_ende_ctc_distilled": "multi30k_ende_ctc on another corpus directory",
    "wmt14_ende_big": "wmt14_ende_base at another size, which SHRINK trains at the same size",
    "tiny": "default shrunk; most of the suite trains it in-process",
    "copy": "default with a copy section (tests/unit/models/test_copy.py trains one)",
    "numbers_long": "default with other data.number_words.max_number and num_numbers",
    "names_copy": "names with a copy section",
    "multi30k_ende_copy": "multi30k_ende with a copy section",
    "spoken_numbers": "tests/e2e/test_speech_training.py trains its feature path on tone audio",
}


def _config_params():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        name = os.path.basename(path)[:-3]
        marks = [pytest.mark.slow] if name in VARIANTS else []
        yield pytest.param(path, id=name, marks=marks)


def test_bad_eval_search_fails_before_any_data(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "--workdir", str(workdir), "--config.train.eval_search=beem"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: train.eval_search='beem' is not one of greedy, beam"
    ]
    assert not (workdir / "vocab.spm").exists() and not workdir.exists()


# --- resuming: parameter shapes decide ---


def _claim(workdir, **changes):
    run = run_config.parse(with_changes(changes))
    shapes = param_shapes(AutoregressiveModel(run.model))
    return claim_workdir(str(workdir), run, shapes, load_state.saved_param_shapes)


def test_same_shapes_resume(tmp_path):
    assert _claim(tmp_path / "w") is False
    assert _claim(tmp_path / "w") is True


def test_shape_neutral_change_resumes(tmp_path):
    _claim(tmp_path / "w")
    assert _claim(tmp_path / "w", **{"model.dropout_rate": 0.3, "train.num_steps": 9}) is True


def test_different_d_ff_refused_naming_a_parameter(tmp_path):
    _claim(tmp_path / "w")
    with pytest.raises(WorkdirError) as e:
        _claim(tmp_path / "w", **{"model.d_ff": 256})
    message = str(e.value)
    assert "\n" not in message
    assert "decoder/layer_0/ffn/wi/bias: (512,) float32 there vs (256,) float32 here" in message


def test_list_steps_skips_unfinished_saves(tmp_path):
    assert checkpoint_format.list_steps(str(tmp_path)) == []
    ckpts = tmp_path / CHECKPOINT_DIR
    for name in ("20", "3", "30.orbax-checkpoint-tmp-17", "notes"):
        (ckpts / name).mkdir(parents=True)
    assert checkpoint_format.list_steps(str(tmp_path)) == [3, 20]


# --- every config file trains two steps ---

# Catalog datasets run on tfds.testing.mock_data (random strings); with no TFDS metadata
# installed, the splits are declared here and the dataset counts as prepared.
MOCK_TRAIN = """
import os, runpy, sys
from unittest import mock
import tensorflow_datasets as tfds
train_py = sys.argv[1]
sys.argv = [train_py, *sys.argv[2:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(train_py)))  # as `python train.py` would
with (
    tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE),
    mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", lambda self: True),
    # mock_data's sources set an unbound __getitems__: batched reads go one record at a time.
    mock.patch.object(
        tfds.core.data_sources.base.BaseDataSource, "__getitems__",
        lambda self, keys: [self[k] for k in keys],
    ),
    mock.patch.object(
        tfds.core.DatasetInfo, "splits", new_callable=mock.PropertyMock,
        return_value={"train": None, "validation": None, "test": None},
    ),
):
    runpy.run_path(train_py, run_name="__main__")
"""

# Every run is 1+1 layers: compiling dominates a two-step run, and grows with the layers, which
# repeat one block (the full stacks are built above, abstractly). Widths are kept, except that
# paper-size models would compile for over a minute on two cores: those (d_model >= 512) run at
# width 64.
DEPTH = ["--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1"]
SHRINK = ["--config.model.d_model=64", "--config.model.d_ff=128", "--config.model.d_kv=16"]

WORDS = ["a", "man", "woman", "dog", "child", "red", "blue", "runs", "on", "the", "street"]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def _load_config(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _corpus(directory, config) -> None:
    """A few generated {split}.{lang} lines under the config's own split names."""
    rng = random.Random(0)
    names = dict(config.data.split_names.to_dict())
    for split, count in (("train", 40), ("validation", 8), ("test", 8)):
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(count)]
        for lang in (config.data.source_lang, config.data.target_lang):
            path = directory / f"{names.get(split, split)}.{lang}"
            path.write_text("".join(f"{line} {lang}\n" for line in lines))


@pytest.mark.parametrize("path", list(_config_params()))
def test_every_config_trains(path, tmp_path, compile_cache):
    config = _load_config(path)
    d = config.data
    args = [
        f"--config={path}",
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.tfds_dir={tmp_path / 'tfds'}",
        "--config.train.num_steps=2",
        "--config.train.batch_size=4",
        "--config.train.eval_batch_size=4",
        "--config.train.eval_max_batches=1",
        "--config.data.max_source_len=16",
        "--config.data.max_target_len=16",
        "--config.data.vocab_size=48",
        # Evaluation runs, without the exposure-bias report: its programs compile for longer
        # than the model's (tests/e2e/test_train.py::test_tiny_config_learns checks it).
        "--config.train.exposure_report=False",
        *DEPTH,
    ]
    if d.max_tokens:
        args.append("--config.data.max_tokens=64")  # 4 rows of 16 tokens
    if config.model.d_model >= 512:
        args += SHRINK
    if d.dataset == "number_words":
        args.append("--config.data.number_words.max_number=99")  # 100 numbers per language
        args.append("--config.data.number_words.always_train_below=0")  # any may be held out
        args.append("--config.data.number_words.num_numbers=0")  # all of them
        command = ["train.py", *args]
    elif d.dataset == "names":
        # each of its ~70 characters (both cases, digits, punctuation) needs a piece
        args[args.index("--config.data.vocab_size=48")] = "--config.data.vocab_size=96"
        args += ["--config.data.names.train=200", "--config.data.names.valid=8"]
        command = ["train.py", *args, "--config.data.names.test=8"]
    elif d.dataset == "spoken_numbers":
        # A dozen tone "utterances" (no espeak-ng) of up to 64 frames.
        args[args.index("--config.data.max_source_len=16")] = "--config.data.max_source_len=64"
        speech = "--config.data.spoken_numbers"
        args += ["--config.data.max_tokens=256", f"{speech}.synthesizer=tones"]
        args += [f"{speech}.max_number=40", f"{speech}.numbers=8"]
        args += [f"{speech}.always_train_below=4", "--config.data.valid_fraction=0.25"]
        command = ["train.py", *args, f"{speech}.utterances_per_number=1"]
    elif d.dataset == "parallel_text":
        _corpus(tmp_path, config)
        command = ["train.py", *args, f"--config.data.parallel_text.corpus_dir={tmp_path}"]
    else:
        runner = tmp_path / "mock_train.py"
        runner.write_text(MOCK_TRAIN)
        command = [str(runner), "train.py", *args]
    # The runs test that each config trains, not how fast: the suite's fast-compile XLA
    # flags (conftest.py); the cache serves programs two configs share (ende/deen).
    env = dict(
        ENV,
        XLA_FLAGS=os.environ["XLA_FLAGS"],
        JAX_COMPILATION_CACHE_DIR=str(compile_cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    result = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step=2" in result.stdout.splitlines()[-1], result.stdout[-2000:]
