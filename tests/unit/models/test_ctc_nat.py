"""The CTC non-autoregressive model: upsampled masks, glancing, decoding, configs, a tiny run."""

import dataclasses
import fractions
import functools
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import tiny_config, tiny_model_config

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config import run as run_config_lib
from flaxformer_lite.config.run import parse
from flaxformer_lite.config.variants import upsampled_length
from flaxformer_lite.constants import BOS_ID, EOS_ID, IMPOSSIBLE, PAD_ID
from flaxformer_lite.models import from_config
from flaxformer_lite.models.ctc_nat import CTCModel, labels_of
from flaxformer_lite.models.nat_transformer import NATransformer
from flaxformer_lite.models.non_autoregressive import NATSearch
from flaxformer_lite.objectives import ctc_loss

# Sources of 5, 3 and 2 tokens (EOS included): 10, 6 and 4 decoder positions at ratio 2. Row
# 0's target repeats a token; row 2's 5 tokens cannot be aligned to its 4 positions.
SOURCES = jnp.array([[5, 6, 7, 8, EOS_ID, 0], [9, 10, EOS_ID, 0, 0, 0], [11, EOS_ID, 0, 0, 0, 0]])
TARGETS = jnp.array(
    [[11, 12, 12, 13, EOS_ID, 0], [14, EOS_ID, 0, 0, 0, 0], [4, 5, 6, 7, 8, EOS_ID]]
)
BATCH = {"inputs": SOURCES, "targets": TARGETS}


@functools.cache
def model_and_params(**kw):
    """A one-layer model at ratio 2 and its parameters (cached: tests share compilations)."""
    config = tiny_model_config(num_encoder_layers=1, num_decoder_layers=1)
    model = CTCModel(config, upsample_ratio=2.0, **kw)
    init = jax.jit(lambda key: model.init(key, {"inputs": SOURCES.shape, "targets": (3, 6)}))
    return model, nn.meta.unbox(init(jax.random.PRNGKey(0)))


def collapse(symbols):
    out, previous = [], None
    for s in symbols:
        if s != previous and s != PAD_ID:
            out.append(int(s))
        previous = s
    return out


def test_decoder_length_is_ceil_of_ratio_times_source_length():
    lengths = jnp.arange(70)
    for ratio in (1.0, 1.1, 1.5, 2.0, 2.2, 3.0):
        exact = [math.ceil(fractions.Fraction(str(ratio)) * s) for s in range(70)]
        np.testing.assert_array_equal(upsampled_length(lengths, ratio), exact)
        assert [upsampled_length(s, ratio) for s in range(70)] == exact
    model, _ = model_and_params()
    valid = model.decoder_valid(SOURCES != 0)
    assert valid.shape == (3, 12)
    np.testing.assert_array_equal(valid.sum(-1), [10, 6, 4])


def test_labels_are_the_tokens_before_eos():
    labels = labels_of(TARGETS)
    np.testing.assert_array_equal(labels.tokens[0], [11, 12, 12, 13, 0, 0])
    np.testing.assert_array_equal(labels.valid.sum(-1), [4, 1, 5])


def test_training_passes_equal_the_single_pass_without_glancing():
    """loss (encoder, copy and decoder applied one by one) and evaluate (the module's call)
    compute the same CTC loss; the unalignable row is out of both."""
    model, params = model_and_params(glance_start=0.0, glance_end=0.0)
    _, sums = jax.jit(model.loss)(params, BATCH, jax.random.PRNGKey(1), 0)
    evaluated = jax.jit(model.evaluate)(params, BATCH)
    np.testing.assert_allclose(sums["loss"], evaluated["loss"], rtol=1e-5)
    assert float(sums["tokens"]) == float(evaluated["tokens"]) == 5.0  # 4 + 1: row 2 is out
    assert float(sums["unalignable"]) == 1.0 and float(sums["sequences"]) == 3.0
    assert float(evaluated["loss"]) < 100.0  # no 1e5 of an unalignable row
    assert "glanced" not in sums  # no first pass


def test_padding_changes_nothing():
    """Source padding content, decoder padding content: the loss and the outputs at valid
    positions stay; attention to padded keys is exactly 0."""
    model, params = model_and_params()
    valid = SOURCES != 0
    noisy = jnp.where(
        valid, SOURCES, jax.random.randint(jax.random.PRNGKey(3), SOURCES.shape, 4, 29)
    )
    plain = jax.jit(model.evaluate)(params, BATCH)
    other = jax.jit(model.evaluate)(params, {**BATCH, "inputs": noisy, "inputs_valid": valid})
    for key in ("loss", "tokens", "seq_correct", "aligned_errors"):
        np.testing.assert_allclose(other[key], plain[key], rtol=1e-6)

    module, variables = model.module, {"params": params}
    decoder_valid = model.decoder_valid(valid)
    labels = labels_of(TARGETS)

    @jax.jit
    def run(tokens, vectors):
        """(logits at the valid decoder positions, CTC loss) of these decoder inputs."""
        encoded = module.apply(variables, SOURCES, valid, method=NATransformer.encode)
        logits = module.apply(
            variables,
            encoded,
            valid,
            tokens,
            decoder_valid,
            copied=vectors,
            mask_id=BOS_ID,
            method=NATransformer.decode,
        )
        nll = ctc_loss.ctc_nll(
            model.emittable(logits), decoder_valid, labels.tokens, labels.valid, 0
        )
        return jnp.where(decoder_valid[..., None], logits, 0.0), nll

    copied = jax.jit(
        lambda: module.apply(
            variables, SOURCES, valid, decoder_valid.sum(-1), 12, method=NATransformer.copied_inputs
        )
    )()
    tokens = jnp.where(decoder_valid, BOS_ID, PAD_ID)
    garbage = jax.random.randint(jax.random.PRNGKey(4), tokens.shape, 4, 29)
    noise = jax.random.normal(jax.random.PRNGKey(5), copied.shape) * 10
    logits, nll = run(tokens, copied)
    logits2, nll2 = run(
        jnp.where(decoder_valid, tokens, garbage),
        jnp.where(decoder_valid[..., None], copied, noise),
    )
    np.testing.assert_allclose(logits2, logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nll2, nll, rtol=1e-6)

    names = ("decoder/self/0", "decoder/cross/0")
    weights = jax.jit(model.attention_weights, static_argnums=2)(params, BATCH, names)
    assert weights["decoder/self/0"].shape == (3, 4, 12, 12)
    hidden = ~decoder_valid[:, None, None, :] & decoder_valid[:, None, :, None]
    assert float(jnp.abs(jnp.where(hidden, weights["decoder/self/0"], 0)).max()) == 0.0
    hidden = ~valid[:, None, None, :] & decoder_valid[:, None, :, None]
    assert float(jnp.abs(jnp.where(hidden, weights["decoder/cross/0"], 0)).max()) == 0.0


def test_glancing_feeds_the_aligned_symbols_of_the_first_pass(monkeypatch):
    """Two decoder calls; the second's revealed inputs are floor(ratio * distance) positions
    of the first pass's best alignment (ratio 1: every wrong position's count)."""
    model, params = model_and_params(glance_start=1.0, glance_end=1.0)
    calls = []
    decode = NATransformer.decode

    def recorded(self, encoded, source_valid, decoder_inputs, *args, **kw):
        logits = decode(self, encoded, source_valid, decoder_inputs, *args, **kw)
        jax.debug.callback(
            lambda i, x: calls.append((np.asarray(i), np.asarray(x))), decoder_inputs, logits
        )
        return logits

    monkeypatch.setattr(NATransformer, "decode", recorded)
    _, sums = jax.jit(model.loss)(params, BATCH, jax.random.PRNGKey(2), 0)
    jax.effects_barrier()
    assert len(calls) == 2
    (first_inputs, first_logits), (second_inputs, _) = calls
    decoder_valid = np.asarray(model.decoder_valid(SOURCES != 0))
    np.testing.assert_array_equal(first_inputs == BOS_ID, decoder_valid)
    labels = labels_of(TARGETS)
    log_probs = jax.nn.log_softmax(model.emittable(jnp.asarray(first_logits)))
    path, _ = ctc_loss.best_alignment(log_probs, decoder_valid, labels.tokens, labels.valid, 0)
    wrong = (np.asarray(log_probs).argmax(-1) != np.asarray(path)) & decoder_valid
    wrong[2] = False  # the unalignable row glances at nothing
    shown = (second_inputs != BOS_ID) & decoder_valid
    np.testing.assert_array_equal(shown.sum(-1), wrong.sum(-1))
    np.testing.assert_array_equal(second_inputs[shown], np.asarray(path)[shown])
    assert float(sums["glanced"]) == float(sums["aligned_errors"]) == wrong.sum()


def test_score_is_the_ctc_log_likelihood():
    model, params = model_and_params()
    token, sequence = jax.jit(model.score)(params, BATCH)
    evaluated = jax.jit(model.evaluate)(params, BATCH)
    np.testing.assert_allclose(sequence[:2].sum(), -evaluated["nll"], rtol=1e-5)
    assert sequence[2] == np.float32(IMPOSSIBLE)  # unalignable
    np.testing.assert_allclose(token.sum(-1), sequence, rtol=1e-6)
    assert float(token[0, 4]) == float(sequence[0])  # all of it at EOS


@pytest.mark.parametrize("max_len", [40, 3])
def test_predict_collapses_the_argmax_of_one_pass(max_len):
    model, params = model_and_params()
    tokens, scores = model.predict(params, BATCH, NATSearch(max_len=max_len))
    assert tokens.shape == (3, 1, max_len) and scores.shape == (3, 1)
    decoder_valid, (logits, _) = jax.jit(model._single_pass)(params, BATCH)
    best = np.asarray(jnp.argmax(model.emittable(logits), -1))
    for row, n in enumerate(np.asarray(decoder_valid.sum(-1))):
        want = collapse(best[row, :n])[: max_len - 1] + [EOS_ID]
        np.testing.assert_array_equal(tokens[row, 0], want + [PAD_ID] * (max_len - len(want)))
        assert BOS_ID not in want[:-1] and EOS_ID not in want[:-1]
    with pytest.raises(ValueError, match="one pass"):
        model.predict(params, BATCH, NATSearch(max_len=9, iterations=4))


# Configs.


def ctc_config(**nat):
    from configs.nat import ctc_section, get_config

    config = get_config()
    config.nat = ctc_section(glance_steps=50)
    config.train.label_smoothing = 0.0
    for k, v in nat.items():
        config.nat[k] = v
    return config


def test_ctc_config_builds_the_ctc_model():
    run = parse(ctc_config(upsample_ratio=2))
    model = from_config.build_model(run)
    assert isinstance(model, CTCModel)
    assert (model.upsample_ratio, model.glance_start, model.glance_end, model.glance_steps) == (
        2.0, 0.5, 0.3, 50,
    )  # fmt: skip
    assert from_config.search_from_config(run) == NATSearch(max_len=16)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: setattr(c.nat, "decoder_inputs", "mask"), "set nat.decoder_inputs='copy'"),
        (lambda c: setattr(c.nat, "length_beam", 2), "nat.length_beam=2 is the cmlm"),
        (lambda c: setattr(c.nat, "length_mode", "fixed"), "nat.length_mode='fixed'"),
        (lambda c: setattr(c.train, "label_smoothing", 0.1), "label_smoothing=0"),
        (lambda c: setattr(c.train, "best_metric", "token_accuracy"), "token_accuracy"),
        (lambda c: setattr(c.nat, "upsample_ratio", 0.5), "nat.upsample_ratio must be"),
        (lambda c: setattr(c.nat, "objective", "ctcc"), "nat.objective='ctcc'"),
        (
            lambda c: setattr(c.model, "positions", "learned") or setattr(c.model, "max_len", 20),
            "raise model.max_len",
        ),
    ],
)
def test_bad_ctc_configs_get_one_line(change, words):
    config = ctc_config()
    change(config)
    with pytest.raises(ConfigError, match=words) as e:
        run_config_lib.validate(config)
    assert "\n" not in str(e.value)


def test_mask_predict_flags_are_refused():
    from flaxformer_lite.translate import line_io, runner

    run = parse(ctc_config())
    assert runner.make_nat_search(run) == NATSearch(max_len=16)
    for kw, words in [
        (dict(iterations=3), "--iterations applies to Mask-Predict"),
        (dict(length_beam=1), "--length_beam applies"),
        (dict(length_scale=2.0), "--length_scale applies"),
        (dict(nbest=2), "--nbest 2"),
    ]:
        with pytest.raises(line_io.InputError, match=words):
            runner.make_nat_search(run, **kw)


# End to end: train.py's loop, then decode.py's decode_cli.


@pytest.fixture(scope="module")
def ctc_workdir(tfds_dir, tmp_path_factory):
    from flaxformer_lite.training import loop

    config = tiny_config(
        tfds_dir, num_steps=40, log_every=10, checkpoint_every=40, label_smoothing=0.0
    )
    with config.unlocked():
        config.nat = ml_collections.ConfigDict(
            dict(objective="ctc", decoder_inputs="copy", upsample_ratio=3.0, glance_steps=40)
        )
    path = str(tmp_path_factory.mktemp("ctc") / "run")
    results = loop.train_and_evaluate(parse(config), path, log=lambda s: None)
    return path, results


def test_ctc_run_trains_and_evaluates(ctc_workdir):
    path, results = ctc_workdir
    with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if r.get("split") == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert train[-1]["loss"] < 0.7 * train[0]["loss"], train
    assert 0 < train[0]["glanced"] < 1 and train[-1]["unalignable"] == 0.0
    assert results["test_nll"] < train[0]["loss"] and 0 <= results["test_exact_match"] <= 1


def test_decode_cli_on_a_ctc_workdir(ctc_workdir, tmp_path):
    from flaxformer_lite.cli import decode as decode_cli
    from flaxformer_lite.translate import line_io

    path, _ = ctc_workdir
    source = tmp_path / "in.txt"
    source.write_text("en 12\n\nde 45\nen 7\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    options = decode_cli.Options(workdir=path, input=str(source), output=str(out))
    decode_cli.run(options)
    lines = out.read_text(encoding="utf-8").splitlines()
    # One line per input line; 40 steps leave the model near all-blank, so they may be empty.
    assert len(lines) == 4 and lines[1] == ""
    reference = tmp_path / "ref.txt"
    reference.write_text("zwölf\nnull\nfünfundvierzig\nsieben\n", encoding="utf-8")
    for bad, words in [
        (dict(score=True, score_tokens=True, reference=str(reference)), "--score_tokens"),
        (dict(alignment=True), "--alignment"),
        (dict(iterations=3), "--iterations"),
    ]:
        with pytest.raises(line_io.InputError, match=words):
            decode_cli.run(dataclasses.replace(options, **bad))
