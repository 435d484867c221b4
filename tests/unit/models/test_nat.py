"""The non-autoregressive model: length classifier, CMLM masks, Mask-Predict, decoding."""

import dataclasses
import functools
import json
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
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.models import from_config
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.nat_transformer import NATransformer, uniform_copy_index
from flaxformer_lite.models.non_autoregressive import NATSearch, NonAutoregressiveModel
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.objectives import nat_loss as objective
from flaxformer_lite.search import mask_predict as search

MASK = BOS_ID
SOURCES = jnp.array([[5, 6, 7, 8, EOS_ID, 0], [9, 10, EOS_ID, 0, 0, 0]])
TARGETS = jnp.array([[11, 12, 13, EOS_ID, 0, 0, 0], [14, EOS_ID, 0, 0, 0, 0, 0]])
BATCH = {"inputs": SOURCES, "targets": TARGETS}


SMALL = dict(num_encoder_layers=1, num_decoder_layers=1)


@functools.cache
def model_and_params(**kw):
    """A one-layer model and its parameters (cached: tests share the compilations; the
    init jitted, one compile where an eager init dispatches each op)."""
    model = NonAutoregressiveModel(tiny_model_config(**SMALL), length_classes=16, **kw)
    shapes = {"inputs": SOURCES.shape, "targets": TARGETS.shape}
    init = jax.jit(lambda key: model.init(key, shapes))
    return model, nn.meta.unbox(init(jax.random.PRNGKey(0)))


# The length classifier.


@functools.partial(jax.jit, static_argnums=0)
def length_logits(model, params):
    module, valid = model.module, SOURCES != 0
    encoded = module.apply({"params": params}, SOURCES, valid, method=module.encode)
    return module.apply({"params": params}, encoded, valid, method=module.length_logits)


def test_offset_class_is_target_minus_source_around_the_middle():
    got = search.offset_class(jnp.array([5, 3, 300, 0]), jnp.array([2, 4, 1, 200]), 256)
    np.testing.assert_array_equal(got, [131, 127, 255, 0])  # clipped at both ends


def test_length_loss_on_hand_made_lengths():
    logits = jnp.array([[0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 3.0], [9.0, 0.0, 0.0, 0.0]])
    target = jnp.array([1, 0, 2])
    rows = jnp.array([True, True, False])  # the third row is padding
    got = objective.length_metrics(logits, target, rows)
    log_p = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(got["length_loss"], -(log_p[0, 1] + log_p[1, 0]), rtol=1e-6)
    assert float(got["length_correct"]) == 1.0  # row 0 right, row 1 wrong (argmax 3)
    assert float(got["length_rows"]) == 2.0


def test_the_model_trains_its_length_classifier_on_the_tokens_before_eos():
    model, params = model_and_params()
    layout = model.layout(TARGETS)
    np.testing.assert_array_equal(layout.lengths, [3, 1])
    np.testing.assert_array_equal(layout.labels[0], [11, 12, 13, 0, 0, 0, 0])  # no EOS
    _, sums = jax.jit(model.loss)(params, BATCH, jax.random.PRNGKey(1), 0)
    logits = length_logits(model, params)
    # Sources hold 5 and 3 tokens (EOS included): offsets 3 - 5 and 1 - 3 around class 8.
    want = objective.length_metrics(logits, jnp.array([6, 6]), jnp.array([True, True]))
    np.testing.assert_allclose(sums["length_loss"], want["length_loss"], rtol=1e-5)


def test_length_candidates_scale_and_rank():
    logits = jnp.full((2, 16), -5.0).at[0, 10].set(3.0).at[0, 11].set(2.0).at[1, 8].set(1.0)
    source = jnp.array([6, 4])  # class c means source + c - 8: lengths 8, 9 and 4
    np.testing.assert_array_equal(
        search.length_candidates(logits, source, beam=2, scale=1.0, max_len=20)[:, 0], [8, 4]
    )
    np.testing.assert_array_equal(
        search.length_candidates(logits, source, beam=2, scale=1.0, max_len=20)[0], [8, 9]
    )
    np.testing.assert_array_equal(
        search.length_candidates(logits, source, beam=1, scale=0.5, max_len=20)[:, 0], [4, 2]
    )
    np.testing.assert_array_equal(
        search.length_candidates(logits, source, beam=1, scale=2.0, max_len=20)[:, 0], [16, 8]
    )
    np.testing.assert_array_equal(  # clipped to what fits
        search.length_candidates(logits, source, beam=1, scale=2.0, max_len=10)[:, 0], [10, 8]
    )


def test_length_scale_changes_decoded_lengths_as_asked():
    model, params = model_and_params()
    classes = jnp.argmax(length_logits(model, params), axis=-1)
    predicted = np.asarray((SOURCES != 0).sum(-1) + classes - 8)  # the classifier's length
    for scale in (0.5, 1.0, 2.0, 3.0):
        tokens, _ = model.predict(params, BATCH, NATSearch(max_len=40, length_scale=scale))
        decoded = np.asarray((tokens[:, 0] != PAD_ID).sum(-1) - 1)  # tokens before EOS
        np.testing.assert_array_equal(decoded, np.clip(np.round(predicted * scale), 1, 39))


# The decoder.


def test_self_attention_is_not_causal():
    """The first position's output depends on the last position's input (jax.grad)."""
    model, params = model_and_params()
    module, variables = model.module, {"params": params}
    valid = SOURCES != 0
    encoded = module.apply(variables, SOURCES, valid, method=module.encode)
    tokens = jnp.full(TARGETS.shape, MASK)
    target_valid = jnp.ones(TARGETS.shape, bool)

    def first_output(vectors):
        logits = module.apply(
            variables,
            encoded,
            valid,
            tokens,
            target_valid,
            copied=vectors,
            mask_id=MASK,
            method=module.decode,
        )
        return logits[:, 0].sum()

    vectors = jax.random.normal(jax.random.PRNGKey(2), (*TARGETS.shape, 32))
    grad = jax.jit(jax.grad(first_output))(vectors)
    assert float(jnp.abs(grad[:, -1]).max()) > 0  # the last position reaches position 0

    # The autoregressive decoder, the same way: the last position never reaches position 0.
    at = Transformer(tiny_model_config(**SMALL))
    at_params = at.init(jax.random.PRNGKey(0), SOURCES, TARGETS)
    at_encoded = at.apply(at_params, SOURCES, method=at.encode)

    def at_first_output(vectors):
        logits = at.apply(
            at_params,
            at_encoded,
            valid,
            jnp.full(TARGETS.shape, 5),
            method=lambda m, e, v, d: m.decoder(
                e,
                d,
                jnp.tril(jnp.ones((2, 7, 7), bool)),
                jnp.broadcast_to(v[:, None, :], (2, 7, 6)),
                deterministic=True,
                input_vectors=(jnp.ones(d.shape, bool), vectors),
            ),
        )
        return logits[:, 0].sum()

    assert float(jnp.abs(jax.jit(jax.grad(at_first_output))(vectors)[:, -1]).max()) == 0.0


def test_uniform_copy_index():
    got = uniform_copy_index(jnp.array([5, 2, 4]), jnp.array([3, 4, 1]), 4)
    # round((S - 1) / (T - 1) * t), round half to even: S=2, T=4 gives 0, 1/3, 2/3, 1.
    np.testing.assert_array_equal(got, [[0, 2, 4, 4], [0, 0, 1, 1], [0, 0, 0, 0]])


def test_copied_inputs_are_the_source_embeddings():
    model, params = model_and_params(decoder_inputs="copy")
    module, variables = model.module, {"params": params}
    copied = module.apply(
        variables, SOURCES, SOURCES != 0, jnp.array([3, 1]), 4, method=NATransformer.copied_inputs
    )
    table = np.asarray(params["shared_embedding"]["embedding"]) * np.sqrt(32)
    np.testing.assert_allclose(copied[0, 1], table[7], rtol=1e-6)  # S=5, T=3: position 1 -> 2
    np.testing.assert_allclose(copied[0, 2], table[EOS_ID], rtol=1e-6)  # ... 4 (EOS)
    np.testing.assert_allclose(copied[1, 0], table[9], rtol=1e-6)  # T=1 copies position 0


# Training.


def test_cmlm_masks_between_one_and_all_tokens():
    valid = jnp.arange(9)[None, :] < jnp.arange(1, 65)[:, None] % 9 + 1  # 1..9 per row
    counts = []
    for seed in range(20):
        masked = objective.random_masks(jax.random.PRNGKey(seed), valid, "uniform")
        assert not bool((masked & ~valid).any())
        n = masked.sum(-1)
        assert bool((n >= 1).all()) and bool((n <= valid.sum(-1)).all())
        counts.append(np.asarray(n))
    assert len(np.unique(np.concatenate(counts))) == 9  # every k in 1..9 occurs
    np.testing.assert_array_equal(objective.random_masks(None, valid, "all"), valid)


def test_loss_covers_the_masked_tokens_only():
    model, params = model_and_params()
    rng = jax.random.PRNGKey(3)
    _, sums = jax.jit(model.loss)(params, BATCH, rng, 0)
    masked = objective.random_masks(
        jax.random.split(rng)[0], model.layout(TARGETS).valid, "uniform"
    )
    assert float(sums["tokens"]) == float(masked.sum())
    model_all, _ = model_and_params(masking="all")
    assert float(model_all.loss(params, BATCH, rng, 0)[1]["tokens"]) == 4.0  # 3 + 1 tokens


def test_fixed_length_labels_fill_with_eos():
    model, _ = model_and_params(length_mode="fixed")
    layout = model.layout(jnp.concatenate([TARGETS, jnp.zeros((1, 7), jnp.int32)]))
    np.testing.assert_array_equal(layout.labels[1], [14, EOS_ID, EOS_ID, EOS_ID, EOS_ID, 3, 3])
    np.testing.assert_array_equal(layout.labels[2], [PAD_ID] * 7)  # a padding row
    assert layout.valid[:2].all() and not layout.valid[2].any()


# Search.


def test_fixed_length_mode_drops_everything_after_the_first_eos():
    tokens = jnp.array([[5, EOS_ID, 6, EOS_ID, 7], [5, 6, 7, 8, 9], [EOS_ID, 4, 4, 4, 4]])
    np.testing.assert_array_equal(
        search.truncate_at_eos(tokens, EOS_ID, PAD_ID),
        [[5, EOS_ID, 0, 0, 0], [5, 6, 7, 8, EOS_ID], [EOS_ID, 0, 0, 0, 0]],
    )
    model, params = model_and_params(length_mode="fixed")
    out, _ = model.predict(params, BATCH, NATSearch(max_len=9, iterations=2))
    out = np.asarray(out[:, 0])
    assert ((out == EOS_ID).sum(-1) == 1).all()
    for row in out:
        end = list(row).index(EOS_ID)
        assert (row[end + 1 :] == PAD_ID).all() and (row[:end] != PAD_ID).all()


class Recorder:
    """A fake decoder: fixed confidences per (row, position) and a record of its inputs."""

    def __init__(self, confidence):
        self.confidence = np.asarray(confidence, np.float32)  # [R, W]
        self.inputs = []

    def record(self, tokens):
        self.inputs.append(np.asarray(tokens))

    def __call__(self, tokens, valid):
        jax.debug.callback(self.record, tokens)
        # Token 4 + position with probability `confidence`; the other 19 share the rest.
        r, w = tokens.shape
        conf = jnp.asarray(self.confidence)
        logits = jnp.broadcast_to((jnp.log1p(-conf) - jnp.log(19.0))[..., None], (r, w, 20))
        token = 4 + jnp.arange(w)[None, :]
        return logits.at[jnp.arange(r)[:, None], jnp.arange(w)[None, :], token].set(jnp.log(conf))


@pytest.mark.parametrize("iterations", [1, 4])
def test_mask_predict_calls_the_decoder_iterations_times_and_remasks_the_weakest(iterations):
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.2, 0.9, (2, 8))
    lengths = jnp.array([8, 5])
    fake = Recorder(confidence)
    tokens, scores = jax.jit(
        lambda n: search.mask_predict(
            fake, n, width=8, iterations=iterations, mask_id=MASK, pad_id=PAD_ID
        )
    )(lengths)
    jax.effects_barrier()
    assert len(fake.inputs) == iterations  # one decoder call per iteration, in one scan
    valid = np.arange(8)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_array_equal(fake.inputs[0] == MASK, valid)  # call 0: all masked
    for t in range(1, iterations):
        masked = fake.inputs[t] == MASK
        for r, n in enumerate(np.asarray(lengths)):
            count = n * (iterations - t) // iterations
            assert masked[r].sum() == count
            weakest = np.argsort(np.where(valid[r], confidence[r], np.inf), kind="stable")[:count]
            assert set(np.flatnonzero(masked[r])) == set(weakest)
    np.testing.assert_array_equal(tokens, np.where(valid, 4 + np.arange(8), PAD_ID))
    np.testing.assert_allclose(scores, np.where(valid, np.log(confidence), 0), rtol=1e-5)


def test_remask_breaks_ties_by_position():
    got = search.remask(jnp.array([[0.5, 0.1, 0.1, 0.9]]), jnp.ones((1, 4), bool), jnp.array([2]))
    np.testing.assert_array_equal(got, [[False, True, True, False]])


def test_best_candidate_orders_by_mean_log_probability():
    tokens = jnp.arange(2 * 3 * 4).reshape(2, 3, 4)
    scores = jnp.array([[[-1.0, -1, 0, 0], [-0.5, -0.5, -0.5, 0], [-4.0, 0, 0, 0]]] * 2)
    lengths = jnp.array([[2, 3, 1]] * 2)
    best, mean = search.best_candidate(tokens, scores, lengths)
    np.testing.assert_allclose(mean[0], [-0.5, -1.0, -4.0])
    np.testing.assert_array_equal(best[0, 0], tokens[0, 1])


def test_predict_is_one_decoder_call_per_iteration(monkeypatch):
    model, params = model_and_params()
    calls = []
    decode = NATransformer.decode

    def counted(self, *args, **kw):
        jax.debug.callback(lambda: calls.append(1))
        return decode(self, *args, **kw)

    monkeypatch.setattr(NATransformer, "decode", counted)
    for iterations in (1, 3):
        calls.clear()
        model.predict(params, BATCH, NATSearch(max_len=11, iterations=iterations, length_beam=2))
        jax.effects_barrier()
        assert len(calls) == iterations


def test_length_beam_returns_the_candidates_best_first():
    model, params = model_and_params()
    tokens, scores = model.predict(params, BATCH, NATSearch(max_len=40, length_beam=3))
    assert tokens.shape == (2, 3, 40) and scores.shape == (2, 3)
    assert bool((jnp.diff(scores, axis=-1) <= 0).all())
    single, single_score = model.predict(params, BATCH, NATSearch(max_len=40, length_beam=1))
    # The most likely length is among the candidates, scored the same.
    assert any(np.array_equal(tokens[b, j], single[b, 0]) for b in range(2) for j in range(3)), (
        "the top length's hypothesis is a candidate"
    )
    assert bool((scores[:, 0] >= single_score[:, 0] - 1e-6).all())


# The autoregressive model is untouched.


def test_autoregressive_model_is_unchanged_by_the_nat_code():
    run = parse(tiny_config("/nonexistent"))
    at = from_config.build_model(run)
    assert at == AutoregressiveModel(run.model, label_smoothing=run.train.label_smoothing)
    # The decoder's optional input vectors, nowhere used, change no bit of the logits.
    module = Transformer(tiny_model_config(**SMALL))
    params = module.init(jax.random.PRNGKey(0), SOURCES, TARGETS)
    encoded = module.apply(params, SOURCES, method=module.encode)
    valid = SOURCES != 0

    def logits(**kw):
        return module.apply(
            params,
            encoded,
            valid,
            TARGETS,
            method=lambda m, e, v, d: m.decoder(
                e,
                d,
                jnp.tril(jnp.ones((2, 7, 7), bool)),
                jnp.broadcast_to(v[:, None, :], (2, 7, 6)),
                deterministic=True,
                **kw,
            ),
        )

    unused = (jnp.zeros(TARGETS.shape, bool), jnp.ones((2, 7, 32)))
    np.testing.assert_array_equal(logits(), logits(input_vectors=unused))


# Configs.


def nat_config(**nat):
    from configs.nat import get_config

    config = get_config()
    for k, v in nat.items():
        config.nat[k] = v
    return config


def test_nat_config_builds_the_nat_model():
    run = parse(nat_config(decoder_inputs="copy", masking="all"))
    model = from_config.build_model(run)
    assert isinstance(model, NonAutoregressiveModel)
    assert (model.decoder_inputs, model.masking, model.length_loss_weight) == ("copy", "all", 0.1)
    assert from_config.search_from_config(run) == NATSearch(max_len=16, iterations=4)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: setattr(c.data, "batching", "pack"), "data.batching='pack'"),
        (lambda c: setattr(c.train, "exposure_report", True), "exposure_report"),
        (lambda c: setattr(c.scheduled_sampling, "mode", "argmax"), "scheduled_sampling"),
        (
            lambda c: setattr(c.nat, "length_mode", "fixed") or setattr(c.nat, "length_beam", 3),
            "length_beam",
        ),
        (lambda c: setattr(c.nat, "masking", "some"), "nat.masking"),
    ],
)
def test_bad_nat_configs_get_one_line(change, words):
    config = nat_config()
    change(config)
    with pytest.raises(ConfigError, match=words):
        run_config_lib.validate(config)


def test_nat_section_field_names_are_checked():
    config = nat_config()
    with config.unlocked():
        config.nat.iteration = 3
    with pytest.raises(ConfigError, match="nat.iteration is not a nat field"):
        run_config_lib.validate(config)


def test_nat_search_flags_are_checked():
    from flaxformer_lite.translate import line_io, runner

    run_config = parse(nat_config(length_mode="fixed"))
    assert run_config.data.max_target_len == 16
    with pytest.raises(line_io.InputError, match="--length_scale 2.0 scales predicted lengths"):
        runner.make_nat_search(run_config, length_scale=2.0)
    with pytest.raises(line_io.InputError, match="--length_beam 2"):
        runner.make_nat_search(run_config, length_beam=2)
    run_config = parse(nat_config(iterations=7))
    assert runner.make_nat_search(run_config) == NATSearch(max_len=16, iterations=7)
    with pytest.raises(line_io.InputError, match="--nbest 2 needs"):
        runner.make_nat_search(run_config, nbest=2)


def test_model_rejects_unknown_settings():
    with pytest.raises(ValueError, match="length_mode"):
        NonAutoregressiveModel(tiny_model_config(), length_mode="guess")
    with pytest.raises(ValueError, match="copy"):
        NonAutoregressiveModel(tiny_model_config(input_features=8), decoder_inputs="copy")


# End to end: train.py's loop, then decode.py's decode_cli.


@pytest.fixture(scope="module")
def nat_workdir(tfds_dir, tmp_path_factory):
    from flaxformer_lite.training import loop

    config = tiny_config(tfds_dir, num_steps=20)
    with config.unlocked():
        config.nat = ml_collections.ConfigDict(dict(iterations=2, length_beam=2))
    path = str(tmp_path_factory.mktemp("nat") / "run")
    results = loop.train_and_evaluate(parse(config), path, log=lambda s: None)
    return path, results


def test_nat_run_trains_and_evaluates(nat_workdir):
    """20 steps learn: the training loss falls by half a nat (measured 4.70 at step 5 ->
    3.65 at step 20) and the held-out NLL per token is well below a uniform guess over the
    vocabulary (measured 3.46 against ln 64 = 4.16)."""
    from flaxformer_lite.data.tokenizer import Vocabularies

    path, results = nat_workdir
    assert 0 <= results["test_length_accuracy"] <= 1 and 0 <= results["test_exact_match"] <= 1
    with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if r.get("split") == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train
    uniform = np.log(Vocabularies.load(path).target.vocab_size)
    assert results["test_nll"] < uniform - 0.3, (results["test_nll"], uniform)


def test_decode_cli_options_on_a_nat_workdir(nat_workdir, tmp_path, monkeypatch):
    from flaxformer_lite.cli import decode as decode_cli
    from flaxformer_lite.translate import line_io

    path, _ = nat_workdir
    source = tmp_path / "in.txt"
    source.write_text("en 12\n\nde 45\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    options = decode_cli.Options(
        workdir=path, input=str(source), output=str(out), iterations=3, length_beam=2, nbest=2
    )
    decode_cli.run(options)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and lines[1] == "" and lines[0].count("\t") == 3  # 2 hyps, 2 scores
    reference = tmp_path / "ref.txt"
    reference.write_text("zwölf\nnull\nfünfundvierzig\n", encoding="utf-8")
    logged = []
    monkeypatch.setattr(decode_cli, "log", logged.append)
    decode_cli.run(dataclasses.replace(options, reference=str(reference), nbest=1))
    assert any(line.startswith("multi-modality: ") and "of 2 outputs" in line for line in logged)
    for bad, words in [
        (dict(temperature=0.5), "--temperature"),
        (dict(report=True, reference=str(source)), "--report"),
        (dict(nbest=3, length_beam=2), "--nbest 3"),
    ]:
        with pytest.raises(line_io.InputError, match=words):
            decode_cli.run(dataclasses.replace(options, **bad))


def test_multimodality_shares_on_hand_made_outputs():
    from flaxformer_lite.evaluation import multimodality

    outputs = [[5, 5, 6], [5, 6], [7], []]
    references = [[5, 6], [5, 6], [7, 7], [4]]
    m = multimodality.measure(outputs, references)
    assert (m.outputs, m.repeated, m.reference_repeated) == (4, 0.25, 0.25)
    assert m.wrong_length == 0.75 and m.mean_length_difference == -0.25
    assert "25.0% of 4 outputs repeat" in m.line()


def test_a_narrower_decoder_gives_the_same_output():
    """Eager predict decodes as wide as the longest candidate needs, jitted predict as wide
    as max_len allows: the padded positions change nothing."""
    from flaxformer_lite.models.non_autoregressive import decoder_width

    assert [decoder_width(n, 39) for n in (1, 8, 9, 17, 33, 39)] == [8, 8, 16, 32, 39, 39]
    model, params = model_and_params()
    search = NATSearch(max_len=40, iterations=3, length_beam=2)
    narrow = model.predict(params, BATCH, search)
    wide = jax.jit(lambda p, b: model.predict(p, b, search))(params, BATCH)
    np.testing.assert_array_equal(narrow[0], wide[0])
    np.testing.assert_allclose(narrow[1], wide[1], rtol=1e-5, atol=1e-6)
