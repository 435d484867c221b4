"""Tests of flaxformer_lite.data.batching: tokenizing once, length buckets, packing, resuming."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from flaxformer_lite.constants import EOS_ID, PAD_ID
from flaxformer_lite.data import batching
from flaxformer_lite.data.tokenizer import with_eos

NUM_EXAMPLES = 300
MAX_LEN = 48  # longer than any synthetic sentence (40 ids + EOS): nothing is truncated
VOCAB = 64


class IdTokenizer:
    """Text is space-separated ids; ``encode`` reads them back."""

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]


@pytest.fixture(scope="module")
def split() -> list[dict[str, bytes | str]]:
    rng = np.random.default_rng(0)
    examples = []
    for i in range(NUM_EXAMPLES):
        source, target = (rng.integers(4, VOCAB, rng.integers(1, 41)) for _ in range(2))
        # Bytes for half the examples, as TFDS data sources store text.
        text = " ".join(map(str, source))
        examples.append(
            {"source": text.encode() if i % 2 else text, "target": " ".join(map(str, target))}
        )
    return examples


@pytest.fixture(scope="module")
def tokenized(split) -> batching.Tokenized:
    return batching.tokenize_split(
        split, IdTokenizer(), max_source_len=MAX_LEN, max_target_len=MAX_LEN
    )


@pytest.fixture(scope="module")
def example_ids(tokenized) -> dict[tuple[tuple[int, ...], tuple[int, ...]], int]:
    """(source ids, target ids) -> example index; the synthetic pairs are all distinct."""
    ids = {
        (tuple(s.tolist()), tuple(t.tolist())): i
        for i, (s, t) in enumerate(zip(tokenized.sources, tokenized.targets))
    }
    assert len(ids) == NUM_EXAMPLES
    return ids


def _unpad(row: np.ndarray) -> tuple[int, ...]:
    return tuple(row[row != PAD_ID].tolist())


def _bucketed_examples(batch, example_ids) -> list[int]:
    """Example indices of the valid rows; checks that filler rows are all PAD."""
    found = []
    for source, target, valid in zip(batch["inputs"], batch["targets"], batch["valid"]):
        if valid:
            found.append(example_ids[_unpad(source), _unpad(target)])
        else:
            assert not source.any() and not target.any()
    return found


def _packed_examples(batch, example_ids) -> list[int]:
    """Example indices of every segment; checks segments, positions and padding of each row."""
    found = []
    for r in range(batch["valid"].size):
        sides = []
        for key in ("inputs", "targets"):
            ids, seg, pos = (batch[key + s][r] for s in ("", "_segments", "_positions"))
            used = int((seg > 0).sum())
            # Segments 1, 2, ... are contiguous from column 0; padding is zero in all arrays.
            assert (seg[:used] > 0).all() and not seg[used:].any() and not pos[used:].any()
            assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all()
            assert not ids[used:].any() and (ids[:used] != PAD_ID).all()
            examples = []
            for k in range(1, int(seg.max(initial=0)) + 1):
                np.testing.assert_array_equal(pos[seg == k], np.arange((seg == k).sum()))
                examples.append(tuple(ids[seg == k].tolist()))
            sides.append(examples)
        assert len(sides[0]) == len(sides[1]) and bool(sides[0]) == batch["valid"][r]
        found += [example_ids[pair] for pair in zip(*sides)]
    return found


def test_tokenize_split_counts_truncations(split):
    tokenized = batching.tokenize_split(split, IdTokenizer(), max_source_len=12, max_target_len=20)
    words = [[len(str(ex[f]).split()) for ex in split] for f in ("source", "target")]
    assert tokenized.num_sources_truncated == sum(n + 1 > 12 for n in words[0]) > 0
    assert tokenized.num_targets_truncated == sum(n + 1 > 20 for n in words[1]) > 0
    assert tokenized.source_lengths.max() == 12 and tokenized.target_lengths.max() == 20
    for ids, length in zip(tokenized.sources, tokenized.source_lengths):
        assert ids.dtype == np.int32 and ids.size == length and ids[-1] == EOS_ID


def test_with_eos_appends_eos_and_keeps_it_last_when_cutting():
    assert with_eos([], 1) == ([EOS_ID], False)
    assert with_eos([5, 6], 3) == ([5, 6, EOS_ID], False)  # exactly fits
    assert with_eos([5, 6, 7], 3) == ([5, 6, EOS_ID], True)  # no room for EOS after all ids
    assert with_eos([5, 6, 7, 8, 9], 3) == ([5, 6, EOS_ID], True)
    assert with_eos([5, 6, 7], 1) == ([EOS_ID], True)
    ids = [5, 6]
    with_eos(ids, 2)
    assert ids == [5, 6]  # the input is not modified
    with pytest.raises(ValueError, match="max_len"):
        with_eos([5], 0)


def test_default_buckets():
    assert batching.default_buckets(64, 64) == [(8, 8), (16, 16), (32, 32), (64, 64)]
    assert batching.default_buckets(50, 20) == [(8, 8), (16, 16), (32, 20), (50, 20)]


@pytest.mark.parametrize("kwargs", [{"batch_size": 16}, {"max_tokens": 300, "pad_to_multiple": 2}])
def test_buckets_cover_an_epoch_once_with_declared_shapes(tokenized, example_ids, kwargs):
    plan = batching.BucketedBatches(tokenized, buckets=None, seed=0, **kwargs)
    assert len(plan.shapes()) > 1
    found = []
    for batch in plan:
        (rows, source_len), target_len = batch["inputs"].shape, batch["targets"].shape[1]
        assert (rows, source_len, target_len) in plan.shapes()
        assert batch["targets"].shape == (rows, target_len) and batch["valid"].shape == (rows,)
        assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
        if "max_tokens" in kwargs:
            assert rows * max(source_len, target_len) <= 300 and rows % 2 == 0
        examples = _bucketed_examples(batch, example_ids)
        # The smallest default bucket that fits: a smaller one must not fit.
        smaller = [b for b in plan.buckets if sum(b) < source_len + target_len]
        for i in examples:
            src, tgt = tokenized.source_lengths[i], tokenized.target_lengths[i]
            assert not any(src <= s and tgt <= t for s, t in smaller)
        found += examples
    assert sorted(found) == list(range(NUM_EXAMPLES))
    # Only the last batch of a bucket is partial: at most one per shape.
    assert len(found) > sum(b["valid"].size for b in plan) - 16 * len(plan.shapes())


def _plans(tokenized, **kwargs) -> list[batching._Plan]:
    return [
        batching.BucketedBatches(tokenized, buckets=[(16, 16), (48, 48)], batch_size=8, **kwargs),
        batching.PackedBatches(tokenized, rows=4, source_len=64, target_len=64, **kwargs),
    ]


def _assert_batches_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("kind", [0, 1], ids=["bucketed", "packed"])
def test_random_access_equals_sequential_across_epochs(tokenized, kind):
    sequential = _plans(tokenized, seed=3)[kind]
    steps = 2 * len(sequential) + 3
    expected = list(itertools.islice(sequential.iter_from(0), steps))
    resumed = _plans(tokenized, seed=3)[kind]
    for step in np.random.default_rng(0).permutation(steps):  # out of order, across epochs
        _assert_batches_equal(resumed[int(step)], expected[step])
    for step, batch in zip(
        range(len(sequential) - 1, steps), resumed.iter_from(len(sequential) - 1)
    ):
        _assert_batches_equal(batch, expected[step])

    def order(plan, first):
        return [
            batch["inputs"][:, :8].tolist() for batch in (plan[first + i] for i in range(len(plan)))
        ]

    other_seed = _plans(tokenized, seed=4)[kind]
    assert len(other_seed) == len(sequential)
    assert order(other_seed, 0) != order(sequential, 0)
    assert order(sequential, len(sequential)) != order(sequential, 0)  # epoch 1 != epoch 0


@pytest.mark.parametrize("kind", [0, 1], ids=["bucketed", "packed"])
def test_process_rows_concatenate_to_the_global_batch(tokenized, kind):
    single = _plans(tokenized, seed=1)[kind]
    shards = [_plans(tokenized, seed=1, process_index=p, process_count=2)[kind] for p in (0, 1)]
    assert {(r // 2, s, t) for r, s, t in single.shapes()} == shards[0].shapes()
    for step in range(len(single) + 2):
        parts = [shard[step] for shard in shards]
        joined = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        _assert_batches_equal(joined, single[step])


def test_packing_covers_every_example_once_and_pads_less(tokenized, example_ids):
    plan = batching.PackedBatches(tokenized, rows=4, source_len=64, target_len=64, seed=0)
    assert plan.shapes() == {(4, 64, 64)}
    for epoch in (0, 1):
        found = []
        for index in range(len(plan)):
            batch = plan[epoch * len(plan) + index]
            assert all(batch[key].shape == (4, 64) for key in batch if key != "valid")
            found += _packed_examples(batch, example_ids)
        assert sorted(found) == list(range(NUM_EXAMPLES))
    fixed = batching.BucketedBatches(tokenized, buckets=[(MAX_LEN, MAX_LEN)], batch_size=4, seed=0)
    bucketed = batching.BucketedBatches(tokenized, buckets=None, batch_size=4, seed=0)
    assert plan.padding_fraction() < bucketed.padding_fraction() < fixed.padding_fraction()


def test_packing_fallback_keeps_every_example_once(tokenized, example_ids):
    """An epoch needing more rows than planned reuses epoch 0's rows in a new order."""
    plan = batching.PackedBatches(tokenized, rows=1, source_len=64, target_len=64, seed=0)
    used_rows = sum(bool(plan[i]["valid"].any()) for i in range(len(plan)))
    assert used_rows < len(plan)  # spare rows are planned (the fallback is rare)
    plan.batches_per_epoch = used_rows  # no spare rows at all
    rows_of_epoch0 = {tuple(_packed_examples(plan[i], example_ids)) for i in range(len(plan))}
    fallbacks = 0
    for epoch in range(1, 8):
        rows = [
            tuple(_packed_examples(plan[epoch * len(plan) + i], example_ids))
            for i in range(len(plan))
        ]
        assert sorted(itertools.chain(*rows)) == list(range(NUM_EXAMPLES))
        fallbacks += set(rows) == rows_of_epoch0
    assert fallbacks > 0


def test_padding_fraction_matches_the_batches(tokenized):
    for plan in _plans(tokenized, seed=0):
        cells = collections.Counter()
        for batch in itertools.islice(plan.iter_from(0), len(plan) + 3):
            for key in ("inputs", "targets"):
                cells["pad"] += int((batch[key] == PAD_ID).sum())
                cells["all"] += batch[key].size
        assert plan.padding_fraction(len(plan) + 3) == pytest.approx(cells["pad"] / cells["all"])
        assert batching.input_throughput(plan, 5) > 0


def test_invalid_arguments_name_the_fix(tokenized):
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        batching.BucketedBatches(tokenized, buckets=None, seed=0)
    with pytest.raises(ValueError, match="multiple of process_count"):
        batching.BucketedBatches(tokenized, buckets=None, batch_size=5, process_count=2, seed=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        batching.BucketedBatches(tokenized, buckets=None, max_tokens=0, seed=0)
    with pytest.raises(ValueError, match="fit no bucket"):
        batching.BucketedBatches(tokenized, buckets=[(8, 8)], batch_size=4, seed=0)
    with pytest.raises(ValueError, match="max_source_len <= 16"):
        batching.PackedBatches(tokenized, rows=4, source_len=16, target_len=64, seed=0)
    with pytest.raises(IndexError):
        _plans(tokenized, seed=0)[0][-1]


def test_packed_batch_runs_the_model_like_separate_rows(tokenized):
    """The packing arrays are what ``Transformer`` expects: same logits as unpacked rows."""
    jax = pytest.importorskip("jax")
    from flax import linen as nn

    from flaxformer_lite.config import TransformerConfig
    from flaxformer_lite.constants import BOS_ID
    from flaxformer_lite.models.autoregressive import shift_right
    from flaxformer_lite.models.packed_rows import Packing
    from flaxformer_lite.models.transformer import Transformer

    jax.config.update("jax_default_matmul_precision", "highest")
    batch = batching.PackedBatches(tokenized, rows=2, source_len=64, target_len=64, seed=0)[0]
    cfg = TransformerConfig(
        vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
        num_decoder_layers=1, dropout_rate=0.0,
    )  # fmt: skip
    model = Transformer(cfg)
    packing = Packing.of(batch)
    decoder_inputs = shift_right(batch["targets"], BOS_ID, batch["targets_segments"])
    # Random parameters of the right shapes: compiling `init` takes seconds on a CPU.
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), batch["inputs"], decoder_inputs)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: rng.normal(0.0, 0.3, x.shape).astype(x.dtype), nn.meta.unbox(shapes["params"])
    )
    apply = jax.jit(model.apply)  # one compile per shape beats op-by-op dispatch here
    packed = apply({"params": params}, batch["inputs"], decoder_inputs, packing=packing)
    # The same examples, one per row, padded to the row width.
    seg_in, seg_out = batch["inputs_segments"], batch["targets_segments"]
    rows = [(r, k) for r in range(2) for k in range(1, seg_in[r].max() + 1)]
    inputs = np.zeros((len(rows), 64), np.int32)
    targets = np.zeros((len(rows), 64), np.int32)
    for i, (r, k) in enumerate(rows):
        src, tgt = batch["inputs"][r][seg_in[r] == k], batch["targets"][r][seg_out[r] == k]
        inputs[i, : src.size], targets[i, : tgt.size] = src, tgt
    separate = apply({"params": params}, inputs, shift_right(targets, BOS_ID))
    for i, (r, k) in enumerate(rows):
        mask = seg_out[r] == k
        np.testing.assert_allclose(packed[r][mask], separate[i, : mask.sum()], atol=1e-5)
    # Metric sums count examples, not rows: packed (by segment) equals separate rows.
    from flaxformer_lite.objectives import cross_entropy

    by_segment = cross_entropy.metrics_sums(
        packed, batch["targets"], 0.1, batch["targets_segments"]
    )
    by_row = cross_entropy.metrics_sums(separate, targets, 0.1)
    assert float(by_segment["sequences"]) == len(rows)
    for key in by_row:
        np.testing.assert_allclose(by_segment[key], by_row[key], rtol=1e-5, err_msg=key)
