"""FixedBatches against the grain pipeline it replaced: the same batches, batch for batch.

``_grain_make_dataset`` is that pipeline as it was (tokenize per example with
``encode_batch``, grain shuffle + repeat + batch, per-process slicing), kept here as the
reference: training batches must not change, or trained models and their metrics would.
"""

from __future__ import annotations

import functools

import grain
import numpy as np
import pytest

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.data import batching, numbers, pipeline
from flaxformer_lite.data.examples import as_str
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies


def _tokenize_example(example, *, tokenizer, max_source_len, max_target_len):
    inputs, _ = tokenizer.source.encode_batch([as_str(example["source"])], max_source_len)
    targets, _ = tokenizer.target.encode_batch([as_str(example["target"])], max_target_len)
    return {"inputs": inputs[0], "targets": targets[0]}


def _stack_batch(examples, *, batch_size):
    num_real = len(examples)
    batch = {}
    for key in ("inputs", "targets"):
        rows = np.stack([example[key] for example in examples]).astype(np.int32)
        if num_real < batch_size:
            filler = np.full((batch_size - num_real, rows.shape[1]), PAD_ID, dtype=np.int32)
            rows = np.concatenate([rows, filler], axis=0)
        batch[key] = rows
    valid = np.zeros((batch_size,), dtype=bool)
    valid[:num_real] = True
    batch["valid"] = valid
    return batch


def _grain_make_dataset(
    source, tokenizer, *, batch_size, max_source_len, max_target_len, seed, shuffle, repeat,
    drop_remainder, process_index=0, process_count=1,
):  # fmt: skip
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat(None, reseed_each_epoch=True)
    ds = ds.map(
        functools.partial(
            _tokenize_example,
            tokenizer=Vocabularies.of(tokenizer),
            max_source_len=max_source_len,
            max_target_len=max_target_len,
        )
    )
    rows = batch_size // process_count
    ds = ds.batch(
        rows,
        drop_remainder=drop_remainder,
        batch_fn=functools.partial(_stack_batch, batch_size=rows),
    )
    if process_count > 1:
        ds = ds[: len(ds) // process_count * process_count][process_index::process_count]
    return ds


@pytest.fixture(scope="module")
def split() -> list[dict[str, str]]:
    pairs = numbers.generate_pairs(["de", "fr"], 49, seed=1, valid_fraction=0.0, test_fraction=0.0)
    return [{"source": s, "target": t} for s, t in pairs["train"]]  # 100 examples


@pytest.fixture(scope="module")
def tokenizer(split) -> Tokenizer:
    return Tokenizer.train([e["source"] for e in split] + [e["target"] for e in split], 80)


def _assert_same(new, old, steps):
    for step in steps:
        a, b = new[step], old[step]
        assert set(a) == set(b) == {"inputs", "targets", "valid"}
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {step} {key}")


# max_target_len 6 truncates most targets: the EOS-last rule must agree too.
COMMON = dict(max_source_len=5, max_target_len=6)


@pytest.mark.parametrize("process_count", [1, 2])
@pytest.mark.parametrize("seed", [0, 7])
def test_training_batches_are_grains_across_epoch_boundaries(split, tokenizer, seed, process_count):
    # 100 examples in batches of 24: epochs end inside steps 4, 8 and 12.
    train = dict(batch_size=24, seed=seed, shuffle=True, repeat=True, drop_remainder=True)
    for p in range(process_count):
        shard = dict(process_index=p, process_count=process_count)
        tokenized = batching.tokenize_split(split, tokenizer, **COMMON)
        new = batching.FixedBatches(tokenized, **train, **shard)
        old = _grain_make_dataset(split, tokenizer, **COMMON, **train, **shard)
        _assert_same(new, old, range(14))
        _assert_same(pipeline.make_dataset(split, tokenizer, **COMMON, **train, **shard), old, [13])
        assert new.shapes() == {(24 // process_count, 5, 6)}


def test_eval_batches_are_grains_ordered_padded_pass(split, tokenizer):
    ordered = dict(seed=0, shuffle=False, repeat=False, drop_remainder=False)
    old = _grain_make_dataset(split, tokenizer, batch_size=16, **COMMON, **ordered)
    new = batching.eval_batches(split, tokenizer, batch_size=16, **COMMON)
    assert len(new) == len(old) == 7
    _assert_same(new, old, range(7))
    assert new[6]["valid"].tolist() == [True] * 4 + [False] * 12
    assert [batch["valid"].sum() for batch in new] == [16] * 6 + [4]  # iteration: one pass
    with pytest.raises(IndexError):
        new[7]


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_pass_dropping_the_remainder_is_grains(split, tokenizer, shuffle):
    args = dict(batch_size=16, seed=3, shuffle=shuffle, repeat=False, drop_remainder=True)
    for p in range(2):
        shard = dict(process_index=p, process_count=2)
        old = _grain_make_dataset(split, tokenizer, **COMMON, **args, **shard)
        new = pipeline.make_dataset(split, tokenizer, **COMMON, **args, **shard)
        assert len(new) == len(old) == 6
        _assert_same(new, old, range(6))


def test_eval_batches_split_rows_between_processes(split, tokenizer):
    whole = batching.eval_batches(split, tokenizer, batch_size=16, **COMMON)
    parts = [
        batching.eval_batches(
            split, tokenizer, batch_size=16, process_index=p, process_count=2, **COMMON
        )
        for p in range(2)
    ]
    for step in range(len(whole)):
        for key, rows in whole[step].items():
            np.testing.assert_array_equal(np.concatenate([p[step][key] for p in parts]), rows)


def test_an_empty_split_has_no_eval_batches(tokenizer):
    assert len(batching.eval_batches((), tokenizer, batch_size=4, **COMMON)) == 0
