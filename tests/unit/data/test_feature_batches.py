"""Batches of feature sources against a per-example construction; text batches unchanged."""

import numpy as np
import pytest

from flaxformer_lite.data import batching


class _Chars:
    """A tokenizer: one id per character (ord % 50 + 4)."""

    def encode(self, text):
        return [ord(c) % 50 + 4 for c in text]


def _speech_split(n=23, mels=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "features": rng.standard_normal((int(rng.integers(1, 40)), mels)).astype(np.float32),
            "target": str(int(rng.integers(0, 10 ** int(rng.integers(1, 6))))).encode(),
            "source": f"utterance {i}".encode(),
        }
        for i in range(n)
    ]


def _expected(split, ids, width_s, width_t, features):
    """The rows of examples ``ids`` built one at a time (-1: a filler row)."""
    rows = len(ids)
    mels = split[0]["features"].shape[1] if features else 0
    inputs = np.zeros((rows, width_s, mels), np.float32) if features else None
    if not features:
        inputs = np.zeros((rows, width_s), np.int32)
    valid_frames = np.zeros((rows, width_s), bool)
    targets = np.zeros((rows, width_t), np.int32)
    for r, i in enumerate(ids):
        if i < 0:
            continue
        if features:
            x = split[i]["features"][:width_s]
            inputs[r, : len(x)] = x
            valid_frames[r, : len(x)] = True
        else:
            s = _Chars().encode(split[i]["source"].decode())[: width_s - 1] + [3]
            inputs[r, : len(s)] = s
        t = _Chars().encode(split[i]["target"].decode())[: width_t - 1] + [3]
        targets[r, : len(t)] = t
    out = {"inputs": inputs, "targets": targets, "valid": np.asarray(ids) >= 0}
    if features:
        out["inputs_valid"] = valid_frames
    return out


@pytest.mark.parametrize("features", [True, False])
def test_bucketed_batches_equal_the_rows_built_one_by_one(features):
    split = _speech_split()
    if not features:
        split = [{"source": e["source"] * 2, "target": e["target"]} for e in split]
    tok = batching.tokenize_split(split, _Chars(), max_source_len=32, max_target_len=5)
    assert tok.source_features == features
    long = sum(len(e["features"]) > 32 for e in split) if features else 0
    assert tok.num_sources_truncated == long
    plan = batching.BucketedBatches(tok, max_tokens=64, seed=3)
    seen = []
    for step in range(len(plan)):
        batch = plan[step]
        # The batch's examples, then all-PAD filler rows (-1) up to its row count.
        members, _ = plan.step_members(step)
        ids = np.full(batch["valid"].size, -1, np.int64)
        ids[: members.size] = members
        s, t = batch["inputs"].shape[1], batch["targets"].shape[1]
        assert (s, t) in plan.buckets
        want = _expected(split, ids, s, t, features)
        assert batch.keys() == want.keys()
        for key in want:
            assert batch[key].dtype == want[key].dtype, key
            np.testing.assert_array_equal(batch[key], want[key], err_msg=key)
        seen += [int(i) for i in ids if i >= 0]
    assert sorted(seen) == list(range(len(split)))
    if features:  # buckets follow the frame counts: a short utterance is not padded to 32
        assert min(s for s, _ in plan.buckets) == 8


def test_fixed_eval_batches_of_features():
    split = _speech_split(n=5)
    batches = batching.eval_batches(
        split, _Chars(), batch_size=4, max_source_len=48, max_target_len=8
    )
    assert len(batches) == 2
    want = _expected(split, [4, -1, -1, -1], 48, 8, True)
    for key, value in want.items():
        np.testing.assert_array_equal(batches[1][key], value)


def test_packing_refuses_features():
    tok = batching.tokenize_split(_speech_split(), _Chars(), max_source_len=32, max_target_len=5)
    with pytest.raises(ValueError, match="packed rows need token sources"):
        batching.PackedBatches(tok, rows=4, source_len=32, target_len=5, seed=0)
