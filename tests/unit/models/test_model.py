"""Model properties: padding and causality, positions, packing, scan, attention weights."""

import functools
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config
from flax import linen as nn

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.config.model import REMAT_POLICIES
from flaxformer_lite.models import layer_layout
from flaxformer_lite.models.autoregressive import AutoregressiveModel, shift_right
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.nn.embeddings import Embed, sinusoidal_positions
from flaxformer_lite.nn.layers import Dense, project

jax.config.update("jax_default_matmul_precision", "highest")

TINY = tiny_model_config(vocab_size=23, d_model=16, num_heads=2, d_ff=32)
SRC = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])  # row 0: 2 pad positions
TGT = jnp.array([[2, 4, 5, 0, 0], [2, 7, 8, 9, 10]])  # row 0: 2 pad positions


def _init_params(cfg):
    return nn.meta.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), SRC, TGT)["params"])


@functools.cache
def _init(cfg):
    """`cfg`'s parameters, initialised once per config (tests read them, never write):
    a jitted init is one compile where the eager one dispatches each op."""
    return jax.jit(_init_params, static_argnums=0)(cfg)


def _with_pad_row(params, cfg, value):
    """Changes the embedding vector of PAD_ID: the content at every padded position."""
    params = jax.tree.map(lambda x: x, params)
    names = (
        ["shared_embedding"] if cfg.share_embeddings else ["source_embedding", "target_embedding"]
    )
    for name in names:
        table = params[name]["embedding"]
        params[name] = {"embedding": table.at[0].set(value)}
    return params


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("share", [True, False])
def test_content_at_padded_positions_changes_no_real_output(norm, share):
    cfg = TINY.replace(norm=norm, share_embeddings=share, tie_output_embedding=not share)
    params = _init(cfg)
    model = Transformer(cfg)
    other = _with_pad_row(params, cfg, 7.5)
    enc_a = model.apply({"params": params}, SRC, method=Transformer.encode)
    enc_b = model.apply({"params": other}, SRC, method=Transformer.encode)
    assert not np.allclose(enc_a[0, 4:], enc_b[0, 4:])  # the padded positions did change
    np.testing.assert_array_equal(enc_a[0, :4], enc_b[0, :4])
    np.testing.assert_array_equal(enc_a[1], enc_b[1])
    logits_a = np.asarray(model.apply({"params": params}, SRC, TGT))
    logits_b = np.asarray(model.apply({"params": other}, SRC, TGT))
    # Real decoder positions: row 0's first 3, all of row 1. With a tied softmax the PAD
    # row is also the weight of logit 0, so compare the other logits there.
    cols = slice(1, None) if cfg.tie_output_embedding else slice(None)
    np.testing.assert_array_equal(logits_a[0, :3, cols], logits_b[0, :3, cols])
    np.testing.assert_array_equal(logits_a[1, :, cols], logits_b[1, :, cols])


def test_trailing_padding_changes_nothing():
    params = _init(TINY)
    model = Transformer(TINY)
    short = model.apply({"params": params}, SRC[:1, :4], TGT[:1, :3])
    long = model.apply({"params": params}, SRC[:1], TGT[:1])
    np.testing.assert_allclose(short[0], long[0, :3], atol=1e-5)


def test_decoder_is_causal_by_gradient():
    """d logits[t] / d (decoder input embedding at t') == 0 for every t' > t."""
    params = _init(TINY)
    model = Transformer(TINY)
    encoded = model.apply({"params": params}, SRC, method=Transformer.encode)
    table = params["shared_embedding"]["embedding"]
    embedded = jnp.take(table, TGT, axis=0) * math.sqrt(TINY.d_model)  # [B, T, D]

    def per_step_logit_sums(x):
        # Replace the decoder's token embedding by `x`, so the gradient flows to it.
        def intercept(next_fun, args, kwargs, context):
            if context.method_name == "__call__" and isinstance(context.module, Embed):
                return x
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(intercept):
            logits = model.apply(
                {"params": params}, encoded, SRC != 0, TGT, method=Transformer.decode
            )
        return logits.sum(axis=(0, 2))  # [T]

    jac = np.asarray(jax.jit(jax.jacrev(per_step_logit_sums))(embedded))  # [T, B, T, D]
    for t in range(TGT.shape[1]):
        assert np.all(jac[t, :, t + 1 :] == 0.0), f"step {t} sees the future"
        assert np.any(jac[t, 1, : t + 1] != 0.0)


def _encode_perm(cfg, perm):
    params = _init(cfg)
    model = Transformer(cfg)
    src = SRC[1:]  # no padding
    a = model.apply({"params": params}, src, method=Transformer.encode)
    b = model.apply({"params": params}, src[:, perm], method=Transformer.encode)
    return np.asarray(a[0, perm]), np.asarray(b[0])


def test_encoder_without_positions_is_permutation_equivariant():
    perm = np.array([3, 0, 5, 1, 4, 2])
    a, b = _encode_perm(TINY.replace(positions="none"), perm)
    np.testing.assert_allclose(a, b, atol=1e-5)
    a, b = _encode_perm(TINY, perm)
    assert not np.allclose(a, b, atol=1e-3)


def test_sinusoid_table_is_the_paper_formula():
    d = 10
    table = np.asarray(sinusoidal_positions(jnp.arange(50), d))
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)
    # Any length: a position far past training lengths is still the formula.
    far = np.asarray(sinusoidal_positions(jnp.array([1000]), d))[0]
    assert far[0] == pytest.approx(math.sin(1000.0), abs=1e-3)


def test_shift_right_is_teacher_forcing():
    targets = jnp.array([[7, 8, 3, 0], [9, 3, 0, 0]])
    np.testing.assert_array_equal(shift_right(targets, 2), [[2, 7, 8, 3], [2, 9, 3, 0]])


def test_learned_positions_and_gelu_run():
    cfg = TINY.replace(positions="learned", activation="gelu", max_len=16, norm="pre")
    params = _init(cfg)
    assert params["encoder"]["positions"]["pos_embedding"].shape == (16, 16)
    out = Transformer(cfg).apply({"params": params}, SRC, TGT)
    assert out.shape == (2, 5, cfg.padded(23)) and np.all(np.isfinite(out))  # `nn/vocab.py`


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"d_model": 30, "num_heads": 4}, "not divisible"),
        ({"norm": "middle"}, "model.norm"),
        ({"dropout_rate": 1.5}, "dropout_rate"),
        ({"num_heads": 0}, "positive integer"),
        ({"target_vocab_size": 9}, "share_embeddings"),
    ],
)
def test_bad_model_config_names_the_field(changes, words):
    with pytest.raises(ConfigError, match=words):
        TINY.replace(**changes)


def test_packed_rows_equal_separate_rows():
    """Two examples packed into one row give the logits (and loss) of two padded rows."""
    from flaxformer_lite.objectives import cross_entropy

    src_a, src_b = [5, 6, 7, 3], [9, 10, 3]
    tgt_a, tgt_b = [11, 12, 3], [13, 14, 15, 3]
    sep_src = jnp.array([src_a + [0] * 3, src_b + [0] * 4])
    sep_tgt = jnp.array([tgt_a + [0] * 4, tgt_b + [0] * 3])
    packed_src = jnp.array([src_a + src_b])
    packed_tgt = jnp.array([tgt_a + tgt_b])
    packing = Packing(
        inputs_segments=jnp.array([[1] * 4 + [2] * 3]),
        inputs_positions=jnp.array([list(range(4)) + list(range(3))]),
        targets_segments=jnp.array([[1] * 3 + [2] * 4]),
        targets_positions=jnp.array([list(range(3)) + list(range(4))]),
    )
    for norm in ("post", "pre"):
        cfg = TINY.replace(norm=norm)
        params = _init(cfg)
        model = Transformer(cfg)
        sep = model.apply({"params": params}, sep_src, shift_right(sep_tgt, 2))
        dec_in = shift_right(packed_tgt, 2, packing.targets_segments)
        np.testing.assert_array_equal(dec_in, [[2, 11, 12, 2, 13, 14, 15]])
        packed = model.apply({"params": params}, packed_src, dec_in, packing=packing)
        np.testing.assert_allclose(packed[0, :3], sep[0, :3], atol=1e-5)
        np.testing.assert_allclose(packed[0, 3:], sep[1, :4], atol=1e-5)
        loss_sep = cross_entropy.cross_entropy(sep, sep_tgt, 0.1)[0].sum()
        loss_packed = cross_entropy.cross_entropy(packed, packed_tgt, 0.1)[0].sum()
        assert float(loss_packed) == pytest.approx(float(loss_sep), rel=1e-5)


def test_packed_examples_never_see_each_other():
    """Changing the second packed example (source and target) leaves the first unchanged."""
    packing = Packing(
        inputs_segments=jnp.array([[1, 1, 1, 2, 2, 2]]),
        inputs_positions=jnp.array([[0, 1, 2, 0, 1, 2]]),
        targets_segments=jnp.array([[1, 1, 2, 2, 2]]),
        targets_positions=jnp.array([[0, 1, 0, 1, 2]]),
    )
    params = _init(TINY)
    model = Transformer(TINY)
    src = jnp.array([[5, 6, 3, 9, 10, 3]])
    dec = jnp.array([[2, 11, 2, 13, 14]])
    a = model.apply({"params": params}, src, dec, packing=packing)
    b = model.apply(
        {"params": params}, src.at[0, 3:5].set(17), dec.at[0, 3:].set(19), packing=packing
    )
    np.testing.assert_array_equal(a[0, :2], b[0, :2])
    assert not np.allclose(a[0, 3:], b[0, 3:])


def _loss_and_grads(cfg, params):
    loss = lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, SRC, TGT) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)


@functools.cache
def _unrolled_loss_and_grads():
    return _loss_and_grads(TINY, _init(TINY))


# The default suite runs one policy that saves nothing and one that saves some matmuls;
# the policies taking the same code path with another jax.checkpoint_policies entry are slow.
_SAME_PATH = ("nothing_saveable", "dots_saveable")


@pytest.mark.parametrize(
    "remat",
    [pytest.param(r, marks=pytest.mark.slow) if r in _SAME_PATH else r for r in REMAT_POLICIES],
)
def test_scan_over_layers_equals_unrolled(remat):
    """The same weights, stored stacked and run as one lax.scan: same logits, loss and
    gradients (the stacked gradients are the unrolled ones stacked), with every remat
    policy (unrolled with the policy too)."""
    params = _init(TINY)
    stacked = layer_layout.stack(params)
    assert stacked["decoder"]["layers"]["ffn"]["wi"]["kernel"].shape == (2, 16, 32)
    assert "layer_0" not in stacked["decoder"]
    scanned = TINY.replace(scan_layers=True, remat=remat)
    np.testing.assert_allclose(
        Transformer(scanned).apply({"params": stacked}, SRC, TGT),
        Transformer(TINY).apply({"params": params}, SRC, TGT),
        atol=1e-5,
    )
    loss_u, g_unrolled = _unrolled_loss_and_grads()
    runs = [(scanned, stacked, lambda g: g)]
    if remat != "none":
        runs.append((TINY.replace(remat=remat), params, layer_layout.stack))
    for cfg, p, restack in runs:
        loss, grads = _loss_and_grads(cfg, p)
        np.testing.assert_allclose(loss, loss_u, rtol=1e-6)
        expected = layer_layout.stack(g_unrolled)
        for a, b in zip(jax.tree.leaves(restack(grads)), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_scanned_gradient_compiles_one_layer_body_and_stacks_no_weights():
    """2 and 4 scanned layers lower to the same matmuls (one body per stack), and no
    [L, ...] array is concatenated per call: the scan reads the weights as stored."""

    def lowered(n):
        cfg = TINY.replace(scan_layers=True, num_encoder_layers=n, num_decoder_layers=n)
        params = jax.eval_shape(lambda: _init_params(cfg))
        loss = lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, SRC, TGT) ** 2)
        return jax.jit(jax.grad(loss)).lower(params).as_text()

    two, four = lowered(2), lowered(4)
    assert two.count("stablehlo.dot_general") == four.count("stablehlo.dot_general") > 0
    assert not re.search(r"stablehlo.concatenate[^\n]*-> tensor<4x", four)


def test_scanned_parameters_are_stored_stacked_with_an_unsharded_layer_axis():
    """init stores [L, ...] leaves under "layers", whose logical axis the rules replicate;
    unstacking gives the unrolled model's tree."""
    from flaxformer_lite.parallel import partitioning

    def init(cfg):
        return jax.eval_shape(lambda: Transformer(cfg).init(jax.random.PRNGKey(0), SRC, TGT))

    boxed = init(TINY.replace(scan_layers=True))
    specs = nn.get_partition_spec(boxed)["params"]
    assert tuple(specs["encoder"]["layers"]["ffn"]["wi"]["kernel"]) == ("layers", "embed", "mlp")
    assert dict(partitioning.LOGICAL_RULES)["layers"] is None
    shapes = jax.tree.map(jnp.shape, layer_layout.unstack(nn.meta.unbox(boxed["params"])))
    assert shapes == jax.tree.map(jnp.shape, nn.meta.unbox(init(TINY)["params"]))


def test_parameters_in_the_other_layout_are_refused_with_the_conversion():
    params = _init(TINY)
    with pytest.raises(ValueError, match="layer_layout.to_layout"):
        Transformer(TINY.replace(scan_layers=True)).apply({"params": params}, SRC, TGT)
    with pytest.raises(ValueError, match="scan_layers=False"):
        Transformer(TINY).apply({"params": layer_layout.stack(params)}, SRC, TGT)


def test_unknown_remat_policy_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="model.remat='dots'.*dots_with_no_batch_dims_saveable"):
        TINY.replace(remat="dots")
    assert TINY.replace(remat=True).remat == "full"  # run configs saved when it was a switch
    assert TINY.replace(remat=False).remat == "none"


@pytest.mark.parametrize(
    "x_shape, kernel_shape, in_dims, spec",
    [
        ((2, 5, 8), (8, 3, 4, 2), 1, "btd,dcnh->btcnh"),  # stacked Q/K/V
        ((2, 5, 4, 2), (4, 2, 8), 2, "btnh,nhd->btd"),  # W_O over heads
        ((7, 8), (8, 16), 1, "md,df->mf"),
    ],
)
def test_project_is_the_einsum_with_its_gradients(x_shape, kernel_shape, in_dims, spec):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=kernel_shape), jnp.float32)
    got = project(x, w, in_dims)
    np.testing.assert_allclose(got, jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
    ct = jnp.asarray(rng.normal(size=got.shape), jnp.float32)
    ours = jax.grad(lambda x, w: jnp.sum(project(x, w, in_dims) * ct), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w) * ct), argnums=(0, 1))(x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dense_has_flax_dense_parameters_and_output():
    cfg = TransformerConfig(vocab_size=11, d_model=8, d_ff=16, num_heads=2)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 8)), jnp.float32)
    ours = Dense(16, cfg, ("embed", "mlp"))
    params = nn.meta.unbox(ours.init(jax.random.PRNGKey(0), x))
    theirs = nn.DenseGeneral(16, kernel_init=nn.initializers.xavier_uniform())
    ref_params = theirs.init(jax.random.PRNGKey(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, ref_params)
    np.testing.assert_allclose(params["params"]["kernel"], ref_params["params"]["kernel"])
    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), rtol=1e-5)


FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "param_shapes.json"


def test_parameter_paths_and_shapes_are_those_of_existing_checkpoints():
    """The fixture was recorded from the model before the folders were introduced: every
    workdir written since restores into today's parameter tree."""
    recorded = json.loads(FIXTURE.read_text())
    for name, variant in recorded["variants"].items():
        changes = dict(variant["config"])
        # Recorded before the vocabulary was padded: such run configs read as unpadded.
        changes.setdefault("vocab_multiple", 1)
        if "param_dtype" in changes:
            changes["param_dtype"] = jnp.dtype(changes["param_dtype"])
        model = AutoregressiveModel(TransformerConfig(**recorded["base"], **changes))
        shapes = {"inputs": (1, 7), "targets": (1, 5)}
        init = lambda m=model, s=shapes: m.init(jax.random.PRNGKey(0), s)
        tree = nn.meta.unbox(jax.eval_shape(init))
        flat = {
            "/".join(k.key for k in path): [list(leaf.shape), jnp.dtype(leaf.dtype).name]
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        }
        assert flat == variant["params"], name


@pytest.mark.parametrize("dropout_rng", ["hash", "threefry"])
def test_scan_equals_unrolled_with_dropout(dropout_rng):
    """The scanned layers draw the dropout keys the unrolled ones draw: same loss and
    gradients in training mode, so a resume may flip `scan_layers`."""
    cfg = TINY.replace(dropout_rate=0.3, attention_dropout_rate=0.2, dropout_rng=dropout_rng)
    batch = {"inputs": SRC, "targets": TGT.at[:, 0].set(7)}
    params = _init(cfg)
    key = jax.random.PRNGKey(3)
    results = []
    for scan in (False, True):
        model = AutoregressiveModel(cfg.replace(scan_layers=scan), label_smoothing=0.1)
        loss = jax.jit(jax.value_and_grad(lambda p, m=model: m.loss(p, batch, key, 0)[0]))
        results.append(loss(layer_layout.to_layout(params, scan)))
    (loss_u, grad_u), (loss_s, grad_s) = results
    grad_u = layer_layout.stack(grad_u)
    no_dropout = AutoregressiveModel(TINY).loss(params, batch, key, 0)[0]
    assert abs(float(loss_u) - float(no_dropout)) > 1e-3  # dropout is really on
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad_s), jax.tree.leaves(grad_u), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


LAYERS = ("encoder/self/1", "decoder/self/0", "decoder/cross/-1")


def test_attention_weights_on_every_path_inside_a_jitted_train_step():
    """Cross- and self-attention probabilities read from the unrolled model, with
    scan_layers and with the fast kernel, inside one jitted gradient step: equal, rows
    summing to 1, padded source columns exactly 0."""
    batch = {"inputs": SRC, "targets": TGT.at[:, 0].set(7)}
    params = _init(TINY)
    got = {}
    for mode, cfg in {
        "unrolled": TINY,
        "scan": TINY.replace(scan_layers=True),
        "fast": TINY.replace(attention_impl="fast"),
    }.items():
        module = Transformer(cfg, capture=LAYERS)

        def step(p, cfg=cfg, module=module):
            def loss(p):
                logits, state = module.apply(
                    {"params": p}, SRC, shift_right(batch["targets"], 2), mutable="intermediates"
                )
                return jnp.sum(logits**2), state["intermediates"]

            grads, sown = jax.grad(loss, has_aux=True)(p)
            from flaxformer_lite.models.capture import captured_attention

            return grads, captured_attention(sown, LAYERS, cfg)

        got[mode] = jax.jit(step)(layer_layout.to_layout(params, cfg.scan_layers))[1]
    for name in LAYERS:
        w = np.asarray(got["unrolled"][name])
        assert w.shape[:2] == (2, TINY.num_heads)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
        for mode in ("scan", "fast"):
            np.testing.assert_allclose(got[mode][name], w, atol=1e-6, err_msg=f"{mode} {name}")
    cross = np.asarray(got["unrolled"]["decoder/cross/-1"])  # [B, N, T, S]
    assert np.all(cross[0, :, :, 4:] == 0.0)  # row 0's two padded source positions
    # The protocol gives the same weights.
    proto = AutoregressiveModel(TINY).attention_weights(params, batch, LAYERS)
    for name in LAYERS:
        np.testing.assert_allclose(proto[name], got["unrolled"][name], atol=1e-6)


def test_bad_attention_layer_name_is_refused():
    with pytest.raises(ValueError, match="decoder/cross/I"):
        AutoregressiveModel(TINY).attention_weights(
            _init(TINY), {"inputs": SRC, "targets": TGT}, ("decoder/cross/7",)
        )


def test_feature_encoder_reads_features_and_validity():
    """Continuous inputs with a validity array: padded frames change no real output, and
    the decoder needs no source tokens."""
    cfg = TINY.replace(input_features=5, share_embeddings=False, target_vocab_size=23)
    model = AutoregressiveModel(cfg)
    params = nn.meta.unbox(
        model.init(jax.random.PRNGKey(0), {"inputs": (1, 6, 5), "targets": (1, 5)})
    )
    assert params["encoder"]["input_projection"]["projection"]["kernel"].shape == (5, 16)
    assert "source_embedding" not in params
    feats = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 5)), jnp.float32)
    valid = jnp.array([[True] * 4 + [False] * 2, [True] * 6])
    batch = {"inputs": feats, "inputs_valid": valid, "targets": TGT.at[:, 0].set(7)}
    noisy = dict(batch, inputs=feats.at[0, 4:].set(100.0))
    tok_a, seq_a = model.score(params, batch)
    tok_b, seq_b = model.score(params, noisy)
    np.testing.assert_allclose(seq_a, seq_b, rtol=1e-6)
    assert np.all(np.asarray(seq_a) < 0)
    from flaxformer_lite.models.predict import SearchConfig

    tokens, _ = model.predict(params, batch, SearchConfig("greedy", 4))
    assert tokens.shape == (2, 1, 4)


def test_score_is_the_teacher_forced_log_probability():
    """score() equals log_softmax of the teacher-forced logits at the targets, summed over
    the real tokens."""
    params = _init(TINY)
    targets = jnp.array([[7, 8, 3, 0, 0], [9, 10, 11, 12, 3]])
    model = AutoregressiveModel(TINY)
    tokens, sequences = model.score(params, {"inputs": SRC, "targets": targets})
    logits = Transformer(TINY).apply({"params": params}, SRC, shift_right(targets, 2))
    lp = np.asarray(jax.nn.log_softmax(logits))
    for b in range(2):
        n = int((targets[b] != 0).sum())
        expected = [lp[b, t, int(targets[b, t])] for t in range(n)]
        np.testing.assert_allclose(tokens[b, :n], expected, rtol=1e-5)
        assert np.all(np.asarray(tokens[b, n:]) == 0.0)
        assert float(sequences[b]) == pytest.approx(sum(expected), rel=1e-5)
