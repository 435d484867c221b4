"""The pointer-generator copy head: the mixture, its loss, extended ids, search and the CLIs."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax.core import meta

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.config.run import RunConfig, parse
from flaxformer_lite.config.sections import DataConfig
from flaxformer_lite.config.variants import CopyHead
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenized import tokenize_split
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.models import layer_layout, predict
from flaxformer_lite.models import pointer_generator as pg
from flaxformer_lite.models.autoregressive import AutoregressiveModel, shift_right
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.objectives import copy_loss
from flaxformer_lite.search import beam, sampling

V = 24
CFG = TransformerConfig(
    vocab_size=V,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=2,
    dropout_rate=0.0,
)
INPUTS = np.array([[5, V, 7, V + 1, V, EOS_ID, 0], [6, 8, 9, EOS_ID, 0, 0, 0]], np.int32)
TARGETS = np.array([[V, 9, V + 1, EOS_ID, 0], [8, 8, EOS_ID, 0, 0]], np.int32)


def _model(**kw) -> AutoregressiveModel:
    return AutoregressiveModel(CFG, label_smoothing=0.1, copy=CopyHead(**kw))


@functools.cache
def _params(model, seed=0):
    """`model`'s parameters, initialised once per (model, seed) (tests read them, never
    write): a jitted init is one compile where the eager one dispatches each op."""
    shapes = {"inputs": INPUTS.shape, "targets": TARGETS.shape}
    return meta.unbox(jax.jit(lambda key: model.init(key, shapes))(jax.random.PRNGKey(seed)))


def _with_gate_bias(params, bias: float):
    gate = dict(params["copy_gate"], bias=jnp.float32(bias))
    return {**params, "copy_gate": gate}


def _log_probs(model, params, inputs=INPUTS, targets=TARGETS):
    return _forward(model, params, jnp.asarray(inputs), jnp.asarray(targets))


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, inputs, targets):
    """Teacher-forced log P [B, T, W] of the copy model's module (the head reads its
    attention from the "intermediates" collection)."""
    out, _ = model.module.apply(
        {"params": params},
        inputs,
        shift_right(targets, BOS_ID),
        deterministic=True,
        mutable=["intermediates"],
    )
    return out


# The mixture.


def test_the_mixture_is_a_distribution_in_float32():
    model = _model(heads=(1,))
    log_probs = _log_probs(model, _params(model))
    assert log_probs.dtype == jnp.float32 and log_probs.shape == (2, 5, V + INPUTS.shape[1])
    np.testing.assert_allclose(np.exp(log_probs).sum(-1), 1.0, atol=1e-5)
    # Extended ids no source position holds are impossible, not merely unlikely.
    assert float(jnp.exp(log_probs[1, :, V:]).max()) == 0.0
    assert float(jnp.exp(log_probs[0, :, V + 2 :]).max()) == 0.0


def test_the_scanned_layers_and_the_fast_kernel_give_the_same_mixture():
    """The copied attention is read from either capture layout (scanned or unrolled) and
    from the fast kernel's complement, so the head works on every path."""
    model = _model(layer=0)
    params = _params(model)
    other = AutoregressiveModel(
        dataclasses.replace(CFG, scan_layers=True, attention_impl="fast"),
        label_smoothing=0.1,
        copy=CopyHead(layer=0),
    )
    np.testing.assert_allclose(
        _log_probs(other, layer_layout.stack(params)),
        _log_probs(model, params),
        atol=1e-5,
        rtol=1e-5,
    )


def test_copy_mass_sums_attention_per_id_and_log_mixture_by_hand():
    attention = jnp.array([[[0.5, 0.25, 0.25, 0.0]]])  # [B=1, T=1, S=4]
    copy_ids = jnp.array([[6, 4, 6, 0]])
    np.testing.assert_allclose(
        pg.copy_mass(attention, copy_ids, 8)[0, 0], [0, 0, 0, 0, 0.25, 0, 0.75, 0]
    )
    logits = jnp.log(jnp.array([[[0.1, 0.1, 0.1, 0.1, 0.4, 0.2]]]))  # V = 6
    gate = jnp.log(jnp.array([[0.6 / 0.4]]))  # p_gen = 0.6
    p = np.exp(pg.log_mixture(logits, gate, attention, copy_ids, 8))[0, 0]
    expected = 0.6 * np.array([0.1, 0.1, 0.1, 0.1, 0.4, 0.2, 0, 0])
    expected[4] += 0.4 * 0.25
    expected[6] += 0.4 * 0.75
    np.testing.assert_allclose(p, expected, rtol=1e-6, atol=1e-7)
    # PAD at s = 3 had no attention: id 0 keeps exactly its vocabulary share.
    assert p[0] == pytest.approx(0.06)


def test_a_gate_forced_to_one_gives_the_plain_models_distribution():
    model = _model()
    params = _with_gate_bias(_params(model), 1e4)  # p_gen = 1
    copy = _log_probs(model, params)
    plain_params = {k: v for k, v in params.items() if k != "copy_gate"}
    plain = AutoregressiveModel(CFG)
    # The plain model reads the extended ids as UNK, as the copy model's embeddings do.
    inputs = np.where(INPUTS >= V, UNK_ID, INPUTS)
    targets = np.where(TARGETS >= V, UNK_ID, TARGETS)
    logits = _log_probs(plain, plain_params, inputs, targets)
    np.testing.assert_allclose(copy[..., :V], jax.nn.log_softmax(logits)[..., :V], atol=1e-6)
    assert float(jnp.exp(copy[..., V:]).max()) == 0.0


def test_the_copy_model_has_the_plain_parameters_plus_the_gate():
    copy_params = _params(_model())
    plain = meta.unbox(
        AutoregressiveModel(CFG).init(
            jax.random.PRNGKey(0), {"inputs": INPUTS.shape, "targets": TARGETS.shape}
        )
    )
    shapes = lambda t: jax.tree.map(jnp.shape, t)  # noqa: E731
    assert shapes({k: v for k, v in copy_params.items() if k != "copy_gate"}) == shapes(plain)
    assert set(copy_params["copy_gate"]) == {
        "hidden_kernel",
        "embedded_kernel",
        "context_kernel",
        "bias",
    }


def test_decoder_features_leave_the_logits_bit_identical():
    """The copy head's decoder outputs come from the same ops: the plain path is unchanged."""
    module = Transformer(CFG)
    inputs, dec = jnp.asarray(INPUTS.clip(max=V - 1)), shift_right(jnp.asarray(TARGETS % V), 2)
    params = module.init(jax.random.PRNGKey(0), inputs, dec)["params"]

    def run(m, features):
        valid = inputs != PAD_ID
        encoded = m.encode(inputs, valid)
        from flaxformer_lite.nn import masks

        return m.decoder(
            encoded,
            dec,
            masks.decoder_mask(dec != PAD_ID),
            masks.cross_mask(valid, dec.shape[1]),
            deterministic=True,
            features=features,
        )

    plain = module.apply({"params": params}, module, False, method=lambda m, _m, f: run(m, f))
    logits, feats = module.apply(
        {"params": params}, module, True, method=lambda m, _m, f: run(m, f)
    )
    assert np.array_equal(np.asarray(plain), np.asarray(logits))
    assert feats["hidden"].shape == feats["embedded"].shape == (2, 5, CFG.d_model)


# The loss.


def test_the_smoothed_loss_equals_a_direct_sum_over_the_extended_vocabulary():
    model = _model()
    log_probs = np.asarray(_log_probs(model, _params(model)), np.float64)
    eps = 0.1
    smoothed, nll = copy_loss.token_losses(jnp.asarray(log_probs), jnp.asarray(TARGETS), eps, V)
    for b, t in itertools.product(range(2), range(5)):
        label = TARGETS[b, t]
        if label == PAD_ID:
            assert smoothed[b, t] == nll[b, t] == 0.0
            continue
        q = np.zeros(log_probs.shape[-1])
        q[:V] = eps / (V - 1) if label < V else eps / V
        q[label] = 1.0 - eps
        assert q.sum() == pytest.approx(1.0)
        assert float(smoothed[b, t]) == pytest.approx(-(q * log_probs[b, t]).sum(), rel=1e-5)
        assert float(nll[b, t]) == pytest.approx(-log_probs[b, t, label], rel=1e-6)


def test_gradients_are_finite_where_a_label_has_no_copy_mass():
    model = _model()
    params = _with_gate_bias(_params(model), -30.0)  # almost all mass on copying
    batch = {"inputs": jnp.asarray(INPUTS), "targets": jnp.asarray(TARGETS)}
    # Row 1's targets (8, 8, EOS): 8 is in its source, but 9 of row 0 and BOS never are.
    loss, grads = jax.jit(
        jax.value_and_grad(lambda p: model.loss(p, batch, jax.random.PRNGKey(0), jnp.int32(0))[0])
    )(params)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


# Extended ids.


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["hello my name is anna", "i am bob and this is carl", "hello bob , nice to meet you"]
    return Tokenizer.train(texts * 30, 40)


def test_unknown_source_pieces_get_extended_ids_and_targets_point_at_them(tokenizer):
    vocab = ExtendedVocabulary(tokenizer)
    v = vocab.size
    ids, oov, truncated = vocab.encode_source("i am Žofia Žofia Kłos", 40)
    assert not truncated and ids[-1] == EOS_ID and oov[0] == "Ž"
    assert ids.count(v) == 2  # the same text, the same extended id
    assert all(t < v + len(oov) for t in ids) and UNK_ID not in ids
    target, _ = vocab.encode_target("hello Kłos Žofia Ø", oov, 40)
    assert v in target and v + oov.index("Kł") in target
    assert UNK_ID in target  # Ø is in no source: it stays unknown
    assert vocab.decode(target, oov) == "hello Kłos Žofia  \u2047 "  # as SentencePiece: ▁ + " ⁇ "
    # A cut source keeps no extended id for the pieces it lost.
    ids, oov, truncated = vocab.encode_source("i am Žofia Kłos", 6)
    assert truncated and len(ids) == 6 and "Kł" not in oov
    target, _ = vocab.encode_target("Kłos", oov, 10)
    assert all(t < v for t in target)


def test_extended_decoding_equals_sentencepiece_without_extended_ids(tokenizer):
    vocab = ExtendedVocabulary(tokenizer)
    rng = np.random.default_rng(0)
    for _ in range(300):
        row = rng.integers(0, tokenizer.vocab_size, rng.integers(0, 8)).tolist()
        assert vocab.decode(row) == tokenizer.decode(row)
        # The piece-by-piece path (taken when any extended id is present) agrees too.
        assert vocab.decode([*row, EOS_ID, vocab.size], ("x",)) == tokenizer.decode(row)


def test_tokenize_split_extended_keeps_each_examples_unknown_pieces(tokenizer):
    split = [
        {"source": "i am Žofia".encode(), "target": "hello Žofia".encode()},
        {"source": b"i am bob", "target": b"hello bob"},
    ]
    plain = tokenize_split(split, tokenizer, max_source_len=16, max_target_len=16)
    extended = tokenize_split(split, tokenizer, max_source_len=16, max_target_len=16, extended=True)
    assert plain.oov is None and extended.oov[1] == () and extended.oov[0][0] == "Ž"
    v = tokenizer.vocab_size
    assert v in extended.sources[0] and v in extended.targets[0]
    np.testing.assert_array_equal(plain.sources[1], extended.sources[1])
    np.testing.assert_array_equal(plain.targets[1], extended.targets[1])


# Search.


def test_cached_steps_equal_the_full_forward_pass():
    model = _model(layer=0, heads=(0,))
    params = _params(model, seed=3)
    full = _log_probs(model, params)  # [B, T, W]
    step, cache, first = predict.cached_step(
        model.module, params, jnp.asarray(INPUTS), max_len=TARGETS.shape[1], bos_id=BOS_ID
    )
    step = jax.jit(step)  # one compile, where each eager step dispatches every op
    fed = np.asarray(shift_right(jnp.asarray(TARGETS), BOS_ID))  # extended ids are fed too
    assert np.array_equal(np.asarray(first), fed[:, 0])
    for t in range(TARGETS.shape[1]):
        log_probs, cache = step(jnp.asarray(fed[:, t : t + 1]), cache)
        real = TARGETS[:, t] != PAD_ID  # after its EOS a row is fed PAD, which the full pass masks
        np.testing.assert_allclose(log_probs[real], full[:, t][real], atol=2e-5)


def test_every_search_emits_the_same_ids_cached_or_recomputed():
    model = _model()
    params = _params(model, seed=1)
    run = jax.jit(model.predict, static_argnums=2)
    for method in ("beam", "sample"):  # greedy is beam search with one beam
        outs = [
            run(
                params,
                {"inputs": jnp.asarray(INPUTS)},
                predict.SearchConfig(method, max_len=6, beam_size=3, cached=cached),
                jax.random.PRNGKey(0),
            )[0]
            for cached in (True, False)
        ]
        assert np.array_equal(np.asarray(outs[0]), np.asarray(outs[1])), method
        assert int(outs[0].max()) < V + INPUTS.shape[1]


def test_beam_search_with_the_head_finds_the_copied_hypothesis():
    """A hand-made mixture: greedy takes "a" (0.45); the copied extended id (0.40) followed by
    EOS (0.9) is the likeliest hypothesis, which beam search (K = 2) returns."""
    v, a, b = 6, 4, 5  # PAD UNK BOS EOS a b; the source holds ext id 6, "a" and EOS
    copy_ids = jnp.array([[v, a, EOS_ID]])
    w = v + 3

    def vocab_logits(dist):  # a distribution over the 6 ids -> logits
        return jnp.log(jnp.asarray(dist, jnp.float32))

    # Per previous token: (vocabulary distribution, p_gen, attention over the 3 positions).
    table = {
        BOS_ID: ([0.05, 0.05, 0.0125, 1 / 12, 0.75, 0.0541667], 0.6, [1.0, 0.0, 0.0]),
        a: ([0.05, 0.05, 0.05, 0.3, 0.2, 0.35], 1.0 - 1e-6, [0.0, 1.0, 0.0]),
        b: ([0.1, 0.1, 0.1, 0.5, 0.1, 0.1], 1.0 - 1e-6, [0.0, 0.0, 1.0]),
        v: ([0.02, 0.02, 0.02, 0.9, 0.02, 0.02], 1.0 - 1e-6, [0.0, 0.0, 1.0]),
    }

    def distribution(prev):
        dist, p_gen, attention = table.get(prev, table[b])
        gate = jnp.log(jnp.array([[p_gen / (1 - p_gen)]], jnp.float32))
        logits = vocab_logits(dist)[None, None]
        return pg.log_mixture(logits, gate, jnp.array([[attention]]), copy_ids, w)[0, 0]

    rows = jnp.stack([distribution(p) for p in range(w)])  # [W prev, W next]

    def tokens_to_logits(tokens, cache):
        return rows[tokens[:, 0]], cache

    def brute_force(max_len):
        best, best_score = None, -np.inf
        for n in range(1, max_len + 1):
            for seq in itertools.product(range(w), repeat=n):
                if seq[-1] != EOS_ID or EOS_ID in seq[:-1]:
                    continue
                prev, score = BOS_ID, 0.0
                for tok in seq:
                    score += float(rows[prev, tok])
                    prev = tok
                if score > best_score:
                    best, best_score = list(seq), score
        return best

    expected = brute_force(3)
    assert expected == [v, EOS_ID]
    seqs, _ = beam.beam_search(
        tokens_to_logits,
        {"dummy": jnp.zeros((2, 1))},
        batch_size=1,
        beam_size=2,
        max_len=3,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        alpha=0.0,
    )
    assert np.asarray(seqs[0, 0]).tolist() == [v, EOS_ID, PAD_ID]
    greedy = sampling.greedy_search(
        tokens_to_logits, {}, batch_size=1, max_len=3, bos_id=BOS_ID, eos_id=EOS_ID
    )
    assert np.asarray(greedy[0]).tolist()[0] == a  # greedy misses it


def test_an_unknown_source_piece_is_emitted_and_read_from_the_source(tokenizer):
    """With p_gen = 0 and uniform attention the most frequent source id is copied: the
    unknown piece, emitted as its extended id and decoded as its source text."""
    from flaxformer_lite.translate import input_lines, runner

    cfg = dataclasses.replace(CFG, vocab_size=tokenizer.vocab_size)
    model = AutoregressiveModel(cfg, copy=CopyHead())
    params = meta.unbox(model.init(jax.random.PRNGKey(0), {"inputs": (1, 12), "targets": (1, 4)}))
    params = _with_gate_bias(params, -1e4)
    layer = params["decoder"][f"layer_{cfg.num_decoder_layers - 1}"]["cross_attention"]
    layer = {**layer, "q_kernel": 0 * layer["q_kernel"], "q_bias": 0 * layer["q_bias"]}
    params["decoder"] = {**params["decoder"], f"layer_{cfg.num_decoder_layers - 1}": {
        **params["decoder"][f"layer_{cfg.num_decoder_layers - 1}"], "cross_attention": layer
    }}  # fmt: skip
    line = "ŽaŽaŽaŽ"  # pieces ▁ Ž a Ž a Ž a Ž: the unknown Ž holds 4 of 9 positions
    sources = input_lines.tokenize_lines(tokenizer, [line, ""], 12, extended=True)
    assert sources.oov == [("Ž",), ()]
    run_config = RunConfig(model=cfg, data=DataConfig(max_source_len=12), copy=CopyHead())
    result = runner.decode_lines(
        model,
        params,
        tokenizer,
        run_config,
        sources,
        search=predict.SearchConfig("greedy", max_len=3),
    )
    assert result.output_ids[0] == [tokenizer.vocab_size] * 3
    assert result.texts == ["ŽŽŽ", ""]


# Config and the command lines.


def _copy_config(**copy):
    from configs import tiny

    config = tiny.get_config()
    config.copy = ml_collections.ConfigDict({"layer": -1, "heads": (), **copy})
    return config


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: c.copy.update(layer=1), "copy.layer=1"),
        (lambda c: c.copy.update(heads=(0, 2)), "copy.heads"),
        (lambda c: c.data.update(batching="pack"), "batching='pack'"),
        (
            lambda c: (c.data.update(shared_vocab=False), c.model.update(share_embeddings=False)),
            "one vocabulary",
        ),
        (lambda c: setattr(c, "nat", ml_collections.ConfigDict({})), "nat section"),
        (lambda c: c.copy.update(heads=(-1,)), "tuple of head indices"),
    ],
)
def test_bad_copy_configs_are_one_line_errors(change, words):
    from flaxformer_lite.config import run as run_config

    config = _copy_config()
    change(config)
    with pytest.raises(ConfigError, match=words) as e:
        run_config.validate(config)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def copy_workdir(tmp_path_factory):
    from flaxformer_lite.training import loop

    config = _copy_config()
    config.data.tfds_dir = str(tmp_path_factory.mktemp("tfds"))
    config.train.num_steps = 30
    config.train.checkpoint_every = 30
    path = str(tmp_path_factory.mktemp("copy") / "run")
    losses = []
    results = loop.train_and_evaluate(parse(config), path, log=losses.append)
    return path, results


def test_a_copy_run_trains_and_decode_py_reads_its_extended_ids(copy_workdir, tmp_path):
    from flaxformer_lite.cli import decode as decode_cli

    path, results = copy_workdir
    assert np.isfinite(results["test_loss"]) and "test_exact_match" in results
    source = tmp_path / "in.txt"
    source.write_text("en 12\n\nde 4Ž\n", encoding="utf-8")
    reference = tmp_path / "ref.txt"
    reference.write_text("twelve\n\nvierŽ\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    plots = tmp_path / "plots"
    options = decode_cli.Options(
        workdir=path,
        input=str(source),
        output=str(out),
        beam_size=2,
        reference=str(reference),
        attention_png=str(plots),
    )
    decode_cli.run(options)
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    assert sorted(p.name for p in plots.iterdir()) == ["attention_0000.png", "attention_0002.png"]
    decode_cli.run(dataclasses.replace(options, score=True, attention_png=None, beam_size=4))
    scores = out.read_text(encoding="utf-8").splitlines()
    assert scores[1] == "" and all(float(s) < 0 for s in (scores[0], scores[2]))


def test_the_loss_from_the_mixtures_inputs_equals_the_loss_of_the_full_mixture():
    """Training's path (no [B, T, W] tensor) against the log-probabilities of every id:
    losses, argmax and gradients, with repeated, extended and padded source ids."""
    rng = np.random.default_rng(0)
    b, t, s, v = 3, 5, 6, 11
    logits = jnp.asarray(rng.normal(size=(b, t, v)) * 3, jnp.float32)
    gate = jnp.asarray(rng.normal(size=(b, t)) * 2, jnp.float32)
    attention = rng.random((b, t, s))
    attention[:, :, -1] = 0.0  # a padded source position
    attention = jnp.asarray(attention / attention.sum(-1, keepdims=True), jnp.float32)
    ids = jnp.array([[5, v, 5, 7, v + 1, 0], [3, 4, 4, 4, v, 0], [6, 6, 6, 6, 6, 0]])
    labels = jnp.array([[5, v, v + 1, 3, 0], [4, 4, v, 9, 3], [6, 1, 6, 3, 0]])

    def full(lg, g, a, eps):
        log_probs = pg.log_mixture(lg, g, a, ids, v + s)
        return copy_loss.token_losses(log_probs, labels, eps, v), jnp.argmax(log_probs, -1)

    def parts(lg, g, a, eps):
        parts = {"logits": lg, "gate": g, "attention": a, "copy_ids": ids}
        smoothed, nll, predicted = copy_loss.parts_token_losses(parts, labels, eps)
        return (smoothed, nll), predicted

    for eps in (0.0, 0.1):
        (want, want_nll), want_best = full(logits, gate, attention, eps)
        (got, got_nll), got_best = parts(logits, gate, attention, eps)
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(got_nll, want_nll, atol=1e-5)
        assert np.array_equal(np.asarray(got_best), np.asarray(want_best))
        grads = [
            jax.grad(lambda *x, f=f, e=eps: f(*x, e)[0][0].sum(), argnums=(0, 1, 2))(
                logits, gate, attention
            )
            for f in (full, parts)
        ]
        for g_full, g_parts in zip(*grads):
            np.testing.assert_allclose(g_parts, g_full, atol=1e-5)


def test_evaluation_decodes_each_row_with_its_own_examples_unknown_pieces(tokenizer):
    from flaxformer_lite.data.batching import eval_batches
    from flaxformer_lite.training.evaluate import row_detokenizer

    split = [
        {"source": f"i am {name}".encode(), "target": f"hello {name}".encode()}
        for name in ("Žofia", "bob", "Kłos", "Øyvind")
    ]
    batches = eval_batches(
        split, tokenizer, batch_size=3, max_source_len=16, max_target_len=16, extended=True
    )
    detokenize = row_detokenizer(batches, tokenizer)
    texts: list[str] = []
    for i in range(len(batches)):
        batch = batches[i]
        texts.extend(detokenize(batch["targets"][batch["valid"]], len(texts)))
    assert texts == ["hello Žofia", "hello bob", "hello Kłos", "hello Øyvind"]
    plain = eval_batches(split, tokenizer, batch_size=3, max_source_len=16, max_target_len=16)
    assert "\u2047" in row_detokenizer(plain, tokenizer)(plain[0]["targets"][:1], 0)[0]
