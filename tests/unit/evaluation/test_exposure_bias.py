"""The exposure-bias report: every figure on a hand-made model, numpy vs loops, end to end."""

import dataclasses
import json
import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config
from flax import linen as nn

from flaxformer_lite.cli import decode as decode_cli
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.evaluation import exposure_bias as eb
from flaxformer_lite.evaluation import exposure_probe
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel, shift_right
from flaxformer_lite.models.base import Seq2SeqModel

# ----------------------------------------------------------------------------
from flaxformer_lite.translate import line_io

# A bigram model whose every error is known.
# ----------------------------------------------------------------------------

A, B, C, D = 4, 5, 6, 7  # output tokens
S8, S10, S9 = 8, 10, 9  # source tokens: each starts its own chain
V = 11
HI, MID = 0.6, 0.3  # probability of a row's argmax and of its second choice
# next token given the previous one (the first source token before the first output):
# {previous: (argmax, second)}; the 9 other tokens share 0.1.
ROWS = {A: (B, D), B: (C, EOS_ID), C: (A, D), D: (EOS_ID, A), S8: (A, C), S9: (D, A), S10: (C, B)}
H, M, LO = -math.log(HI), -math.log(MID), -math.log(0.1 / 9)  # the three NLLs of a token


def bigram_table() -> np.ndarray:
    """float32[V, V] log p(next | previous)."""
    table = np.full((V, V), 0.1 / 9)
    for prev in range(V):
        best, second = ROWS.get(prev, (EOS_ID, A))
        table[prev, best], table[prev, second] = HI, MID
    return np.log(table).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class BigramModel(Seq2SeqModel):
    """p(y_t | y_{t-1}) from params["table"], with y_{-1} = the first source token.

    Greedy decoding follows the argmax chains of ROWS: S8 -> a b c a b c ... (a
    cycle, cut at max_len), S9 -> d EOS, S10 -> c a b c a b ...
    """

    def _previous(self, batch):
        return jnp.concatenate([batch["inputs"][:, :1], batch["targets"][:, :-1]], axis=1)

    def score(self, params, batch):
        targets = batch["targets"]
        logp = params["table"][self._previous(batch), targets]  # [B, T]
        logp = jnp.where(targets != PAD_ID, logp, 0.0)
        return logp, logp.sum(axis=-1)

    def forced_argmax(self, params, batch):
        best = jnp.argmax(params["table"][self._previous(batch)], axis=-1).astype(jnp.int32)
        return jnp.where(batch["targets"] != PAD_ID, best, PAD_ID)

    def predict(self, params, batch, search, rng=None):
        def step(carry, _):
            prev, done = carry
            token = jnp.argmax(params["table"][prev], axis=-1).astype(jnp.int32)
            out = jnp.where(done, PAD_ID, token)
            return (token, done | (token == EOS_ID)), out

        start = (batch["inputs"][:, 0], jnp.zeros(batch["inputs"].shape[0], bool))
        _, tokens = jax.lax.scan(step, start, None, length=search.max_len)  # [L, B]
        return tokens.T[:, None, :], jnp.zeros((tokens.shape[1], 1), jnp.float32)

    def init(self, rng, batch_shapes):
        raise NotImplementedError

    def loss(self, params, batch, rng, step):
        raise NotImplementedError

    def evaluate(self, params, batch):
        raise NotImplementedError

    def attention_weights(self, params, batch, layers):
        raise NotImplementedError


def _rows(seqs, width):
    out = np.full((len(seqs), width), PAD_ID, np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


# (source token, gold sequence) of the six examples; greedy output in the comments.
EXAMPLES = [
    (S9, [D, EOS_ID]),  # d EOS: exact
    (S8, [C, D, EOS_ID]),  # a b c ...: first error at 0
    (S8, [A, B, EOS_ID]),  # first error at 2
    (S8, [A, B, C, A, B, D, EOS_ID]),  # first error at 5
    (S10, [B, C, A, B, C, A, B, C, A, B, EOS_ID]),  # c a b ...: first error at 0
    (S8, [A, B, C, A, B, C, A, B, C, A, B, EOS_ID]),  # greedy cut at 10 tokens: error at 10
]
T, L = 12, 10  # gold width, greedy length


def _batch(rows=8):
    """The examples plus all-PAD filler rows, as an eval batch (with "valid")."""
    n = len(EXAMPLES)
    return {
        "inputs": _rows([[s, EOS_ID] for s, _ in EXAMPLES] + [[]] * (rows - n), 2),
        "targets": _rows([g for _, g in EXAMPLES] + [[]] * (rows - n), T),
        "valid": np.arange(rows) < n,
    }


@pytest.fixture(scope="module")
def bigram_report():
    model = BigramModel()
    params = {"table": jnp.asarray(bigram_table())}
    probe = exposure_probe.Probe.for_search(model, predict.SearchConfig("greedy", L))
    host = _batch()
    batch = {k: v for k, v in host.items() if k != "valid"}
    # The filler rows must count for nothing: split the set into two padded batches.
    first, second = ({k: v[rows] for k, v in host.items()} for rows in (slice(0, 4), slice(4, 8)))
    parts = []
    for part in (first, second):
        arrays = probe.arrays(params, {k: v for k, v in part.items() if k != "valid"})
        parts.append(arrays.rows(part["valid"]))
    decoded = exposure_probe.greedy_batch(model, params, batch, probe.search)
    reused = probe.arrays(params, batch, decoded).rows(host["valid"])
    return probe.report(parts), probe.report([reused]), np.asarray(decoded)


def test_greedy_output_of_the_hand_made_model(bigram_report):
    *_, decoded = bigram_report
    cycle = [A, B, C] * 4
    assert decoded[0].tolist() == [D, EOS_ID] + [PAD_ID] * 8
    assert decoded[1].tolist() == cycle[:10]
    assert decoded[4].tolist() == [C, A, B] * 3 + [C]


def test_token_accuracy_and_first_errors_by_hand(bigram_report):
    report, reused, _ = bigram_report
    assert report == reused  # greedy decoded here, or the caller's tokens reused
    assert report.examples == 6
    # forced right: 2 of 2, 1 of 3, 2 of 3, 6 of 7, 9 of 11, 11 of 12 gold tokens.
    assert report.tf_token_accuracy == pytest.approx(31 / 38, abs=1e-12)
    # matched greedy prefixes: 2, 0, 2, 5, 0, 10.
    assert report.fr_token_accuracy == pytest.approx(19 / 38, abs=1e-12)
    assert report.accuracy_gap == pytest.approx(12 / 38, abs=1e-12)
    expected = [0] * T
    expected[0], expected[2], expected[5], expected[10] = 2, 1, 1, 1
    assert list(report.first_error_histogram) == expected
    assert report.first_error_mean == pytest.approx((0 + 2 + 5 + 0 + 10) / 5)


def test_prefix_swap_by_hand(bigram_report):
    report, _, _ = bigram_report
    # Only the first suffix token's previous token changes: NLL(ŷ[k-1] -> y[k]) replaces
    # NLL(y[k-1] -> y[k]) where the prefixes differ.
    want = {
        1: (6, (27 * H + 4 * M + LO) / 6, (26 * H + 4 * M + 2 * LO) / 6, 2 / 6),
        2: (5, (22 * H + 3 * M + LO) / 5, (20 * H + 4 * M + 2 * LO) / 5, 2 / 5),
        4: (3, (15 * H + 2 * M + LO) / 3, (14 * H + 2 * M + 2 * LO) / 3, 1 / 3),
        8: (2, (5 * H + 2 * M) / 2, (4 * H + 2 * M + LO) / 2, 1 / 2),
    }
    assert [s.k for s in report.prefix_swaps] == [1, 2, 4, 8]
    for s in report.prefix_swaps:
        n, gold, own, differ = want[s.k]
        assert s.n == n, s
        assert s.gold_nll == pytest.approx(gold, rel=1e-6)
        assert s.own_nll == pytest.approx(own, rel=1e-6)
        assert s.ratio == pytest.approx(own / gold, rel=1e-6)
        assert s.differ == pytest.approx(differ, abs=1e-12)
    assert all(s.ratio > 1 for s in report.prefix_swaps)  # the greedy prefixes hurt


def test_length_buckets_metrics_and_table(bigram_report):
    report, _, _ = bigram_report
    buckets = [(b.label, b.count, b.tf_exact, b.fr_exact) for b in report.length_buckets]
    assert buckets == [("1-4", 3, 1 / 3, 1 / 3), ("5-8", 1, 0.0, 0.0), ("9-16", 2, 0.0, 0.0)]
    # Token accuracies of the same examples: forced right 2+1+2 | 6 | 9+11, matched 2+0+2 |
    # 5 | 0+10, of 2+3+3 | 7 | 11+12 tokens.
    accuracies = [x for b in report.length_buckets for x in (b.tf_accuracy, b.fr_accuracy)]
    assert accuracies == pytest.approx([5 / 8, 4 / 8, 6 / 7, 5 / 7, 20 / 23, 10 / 23])
    metrics = report.metrics()
    assert metrics["eb_tf_exact_len1-4"] == metrics["eb_fr_exact_len1-4"] == 1 / 3
    assert metrics["eb_count_len9-16"] == 2.0 and "eb_count_len17-32" not in metrics
    assert metrics["eb_prefix_ratio_k4"] == report.prefix_swaps[2].ratio
    assert all(isinstance(v, float) for v in metrics.values())
    assert report.histograms() == {"eb_first_error_hist": list(report.first_error_histogram)}
    table = report.table()
    assert "free-running 0.5000" in table and "0:2 2:1 5:1 10:1" in table
    assert "9-16" in table and len(table.splitlines()) == 4 + 4 + 1 + 3
    assert table.splitlines()[-1].split() == ["9-16", "2", "0.000", "0.000", "0.870", "0.435"]


# ----------------------------------------------------------------------------
# The protocol method of the Transformer.
# ----------------------------------------------------------------------------


def test_forced_argmax_is_the_argmax_of_teacher_forced_logits():
    cfg = tiny_model_config(vocab_size=23, d_model=16, d_ff=32)
    model = AutoregressiveModel(cfg.replace(num_encoder_layers=1, num_decoder_layers=1))
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(4, 23, (3, 6)), jnp.int32)
    targets = rng.integers(4, 23, (3, 5))
    targets[0, 3:], targets[1, 4:] = [EOS_ID, PAD_ID], PAD_ID
    targets = jnp.asarray(targets, jnp.int32)
    # Random parameters of the model's shapes (compiling init would take longer than the test).
    init = lambda key: model.init(key, {"inputs": (3, 6), "targets": (3, 5)})  # noqa: E731
    shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
    params = jax.tree.map(
        lambda a: rng.normal(0, 0.5, a.shape).astype(a.dtype), nn.meta.unbox(shapes)
    )
    batch = {"inputs": inputs, "targets": targets}

    @jax.jit
    def logits_and_argmax(params, batch):
        decoder_inputs = shift_right(batch["targets"], BOS_ID)  # teacher forcing
        logits = model.module.apply({"params": params}, batch["inputs"], decoder_inputs)
        return logits, model.forced_argmax(params, batch)

    logits, got = logits_and_argmax(params, batch)
    want = np.where(targets != PAD_ID, np.argmax(logits, axis=-1), PAD_ID)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------
# The numpy figures against one plain loop per example.
# ----------------------------------------------------------------------------


def _random_set(rng, n=200, t=10, out_len=9, ks=eb.KS):
    """Gold, forced, greedy and NLL arrays with EOS, PAD and cut outputs in every mix."""

    def sequences(width, allow_cut):
        out = np.full((n, width), PAD_ID, np.int32)
        for i in range(n):
            length = rng.integers(1, width + 1)
            out[i, :length] = rng.integers(4, 7, length)  # a small alphabet: many matches
            if not (allow_cut and rng.random() < 0.2):
                out[i, length - 1] = EOS_ID
        return out

    gold = sequences(t, allow_cut=False)
    forced = np.where(gold != PAD_ID, np.where(rng.random(gold.shape) < 0.7, gold, 5), PAD_ID)
    greedy = sequences(out_len, allow_cut=True)
    greedy[:40, :] = gold[:40, :out_len]  # some prefixes equal the gold ones
    nll = rng.random((2, n, len(ks))).astype(np.float32) * 10
    return gold, forced, greedy, nll[0], nll[1]


def _loop_report(gold, forced, greedy, gold_nll, own_nll, ks):
    """The figures, one example at a time, from lists."""

    def seq(row):
        row = [int(x) for x in row if x != PAD_ID]
        return row[: row.index(EOS_ID) + 1] if EOS_ID in row else row

    tf_hits = tf_total = fr_hits = 0
    errors, hist = [], [0] * gold.shape[1]
    swaps = {k: [] for k in ks}
    tf_exact, fr_exact, lengths, tf_hit, fr_hit = [], [], [], [], []
    for i in range(len(gold)):
        y, h = seq(gold[i]), seq(greedy[i])
        f = [int(x) for x in forced[i, : len(y)]]
        tf_hits += sum(a == b for a, b in zip(f, y))
        tf_total += len(y)
        matched = 0
        while matched < len(y) and matched < len(h) and h[matched] == y[matched]:
            matched += 1
        fr_hits += matched
        if matched < len(y):
            errors.append(matched)
            hist[matched] += 1
        content = len(h) - (EOS_ID in h)
        for j, k in enumerate(ks):
            if len(y) > k and content >= k:
                swaps[k].append((gold_nll[i, j], own_nll[i, j], h[:k] != y[:k]))
        tf_exact.append(f == y)
        fr_exact.append(h == y)
        lengths.append(len(y))
        tf_hit.append(sum(a == b for a, b in zip(f, y)))
        fr_hit.append(matched)
    buckets = (tf_exact, fr_exact, lengths, tf_hit, fr_hit)
    return tf_hits / tf_total, fr_hits / tf_total, hist, errors, swaps, buckets


def test_numpy_figures_equal_a_loop_per_example():
    rng = np.random.default_rng(1)
    arrays = _random_set(rng)
    report = eb.compute_report(*arrays)
    tf, fr, hist, errors, swaps, buckets = _loop_report(*arrays, eb.KS)
    tf_exact, fr_exact, lengths, tf_hit, fr_hit = buckets
    assert report.tf_token_accuracy == pytest.approx(tf, abs=1e-12)
    assert report.fr_token_accuracy == pytest.approx(fr, abs=1e-12)
    assert list(report.first_error_histogram) == hist
    assert report.first_error_mean == pytest.approx(np.mean(errors))
    for s in report.prefix_swaps:
        rows = swaps[s.k]
        assert s.n == len(rows) > 0
        assert s.gold_nll == pytest.approx(np.mean([r[0] for r in rows]), rel=1e-6)
        assert s.own_nll == pytest.approx(np.mean([r[1] for r in rows]), rel=1e-6)
        assert s.differ == pytest.approx(np.mean([r[2] for r in rows]))
    assert sum(b.count for b in report.length_buckets) == len(lengths)
    for b in report.length_buckets:
        inside = [i for i, n in enumerate(lengths) if b.low <= n <= (b.high or n)]
        assert b.count == len(inside)
        assert b.tf_exact == pytest.approx(np.mean([tf_exact[i] for i in inside]))
        assert b.fr_exact == pytest.approx(np.mean([fr_exact[i] for i in inside]))
        tokens = sum(lengths[i] for i in inside)
        assert b.tf_accuracy == pytest.approx(sum(tf_hit[i] for i in inside) / tokens)
        assert b.fr_accuracy == pytest.approx(sum(fr_hit[i] for i in inside) / tokens)


def test_an_empty_set_reports_nan_not_an_error():
    report = exposure_probe.Probe(BigramModel(), predict.SearchConfig("greedy", 4)).report([])
    assert report.examples == 0 and math.isnan(report.tf_token_accuracy)
    assert all(s.n == 0 for s in report.prefix_swaps) and report.length_buckets == ()
    assert "over 0 example(s)" in report.table()


def test_metric_writer_takes_a_histogram_list(tmp_path):
    from flaxformer_lite.training.metric_writer import MetricWriter

    writer = MetricWriter(str(tmp_path), tensorboard=True)
    writer.write(5, "validation", {"loss": 1.5, "eb_first_error_hist": [0, 2, 1]})
    writer.write(6, "validation", {"eb_first_error_hist": [0, 0], "x": float("nan")})
    writer.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["eb_first_error_hist"] == [0, 2, 1] and records[0]["loss"] == 1.5
    assert records[1]["eb_first_error_hist"] == [0, 0] and records[1]["x"] == "nan"
    # TensorBoard gets the scalar and the histogram with one bucket per bin, counts as given;
    # the all-zero histogram is left out (TensorBoard has no empty histogram).
    logged = {}
    for path in (tmp_path / "tensorboard").iterdir():
        for event in _events(path):
            for value in event.summary.value:
                logged[event.step, value.tag] = value
    assert logged[5, "validation/loss"].simple_value == 1.5
    histo = logged[5, "validation/eb_first_error_hist"].histo
    assert list(histo.bucket) == [0, 2, 1] and list(histo.bucket_limit) == [1, 2, 3]
    assert histo.num == 3 and histo.min == 1 and histo.max == 2
    assert (6, "validation/eb_first_error_hist") not in logged
    assert math.isnan(logged[6, "validation/x"].simple_value)


def _events(path):
    """The Event protos of a TensorBoard file (TFRecord frames: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
        yield event


# ----------------------------------------------------------------------------
# decode.py --report (end to end in test_decode_cli.py and test_train.py).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, words",
    [
        ({}, "--report needs --reference"),
        ({"reference": "r.txt", "score": True}, "--report decodes and --score does not"),
        ({"reference": "r.txt", "beam_size": 4}, "always decodes greedily"),
        ({"reference": "r.txt", "beam_size": 1, "temperature": 0.7, "nbest": 2}, "--nbest"),
    ],
)
def test_report_flag_errors_are_one_line(tmp_path, changes, words):
    (tmp_path / "r.txt").write_text("x\n")
    changes = {k: str(tmp_path / v) if k == "reference" else v for k, v in changes.items()}
    options = decode_cli.Options(workdir=str(tmp_path / "missing"), report=True, **changes)
    with pytest.raises(line_io.InputError) as e:
        decode_cli.run(options)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_outputs_in_other_pieces_than_the_reference_are_compared_as_text():
    """A model may spell the reference's text with other pieces (p1 p2 for the piece p1p2):
    that is no error; the prefix swap still scores the model's own pieces."""
    from num2words import num2words

    from flaxformer_lite.data.tokenizer import Tokenizer

    texts = [num2words(n) for n in range(300)]
    vocab = Tokenizer.train(texts, vocab_size=80)
    pieces = {vocab.id_to_piece(i): i for i in range(4, vocab.vocab_size)}
    # A reference whose last piece p is also two pieces p[:i] p[i:].
    ids, i = next(
        (ids, i)
        for ids in (vocab.encode(t) for t in texts)
        for i in range(1, len(vocab.id_to_piece(ids[-1])))
        if {vocab.id_to_piece(ids[-1])[:i], vocab.id_to_piece(ids[-1])[i:]} <= set(pieces)
    )
    last = vocab.id_to_piece(ids[-1])
    gold = np.array([ids + [EOS_ID, PAD_ID]], np.int32)
    own = np.array([ids[:-1] + [pieces[last[:i]], pieces[last[i:]], EOS_ID]], np.int32)
    assert vocab.decode(own[0]) == vocab.decode(gold[0])
    canonical = exposure_probe.retokenized(vocab, own)
    np.testing.assert_array_equal(canonical, gold)
    nll = np.ones((1, 1))
    as_text = eb.compute_report(gold, gold, canonical, nll, 2 * nll, (1,), own=own)
    assert as_text.fr_token_accuracy == 1.0 and sum(as_text.first_error_histogram) == 0
    k = len(ids)  # the swapped prefix ends with the model's split piece
    as_text = eb.compute_report(gold, gold, canonical, nll, 2 * nll, (k,), own=own)
    assert as_text.prefix_swaps[0].differ == 1.0 and as_text.prefix_swaps[0].ratio == 2.0
    as_pieces = eb.compute_report(gold, gold, own, nll, 2 * nll, (1,))
    assert as_pieces.fr_token_accuracy < 1.0 and as_pieces.first_error_histogram[k - 1] == 1
