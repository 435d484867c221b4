"""Tests of flaxformer_lite.data: task generation, TFDS storage, tokenizer and fixed batches."""

from __future__ import annotations

import collections
import os
import pickle

import numpy as np
import pytest

from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from flaxformer_lite.data import numbers, pipeline
from flaxformer_lite.data.tokenizer import Tokenizer

LANGS = ("en", "de", "fr")
MAX_NUMBER = 999
SPLIT_ARGS = {
    "languages": LANGS,
    "max_number": MAX_NUMBER,
    "seed": 0,
    "valid_fraction": 0.05,
    "test_fraction": 0.05,
}


@pytest.fixture(scope="module")
def pairs() -> dict[str, list[tuple[str, str]]]:
    return numbers.generate_pairs(**SPLIT_ARGS)


@pytest.fixture(scope="module")
def tokenizer(pairs) -> Tokenizer:
    train = pairs["train"]
    return Tokenizer.train([s for s, _ in train] + [t for _, t in train], vocab_size=400)


@pytest.fixture(scope="module")
def small_source() -> list[dict[str, str]]:
    """100 examples ("de 0" .. "de 99") as a plain list split."""
    split = numbers.generate_pairs(["de"], 99, seed=1, valid_fraction=0.0, test_fraction=0.0)
    return [{"source": s, "target": t} for s, t in split["train"]]


@pytest.fixture(scope="module")
def small_tokenizer(small_source) -> Tokenizer:
    return Tokenizer.train(
        pipeline.texts(small_source, "source") + pipeline.texts(small_source, "target"),
        vocab_size=200,
    )


# ---------------------------------------------------------------------------------------------
# numbers.generate_pairs


def test_generate_pairs_deterministic_disjoint_and_complete(pairs):
    again = numbers.generate_pairs(**SPLIT_ARGS)
    assert again == pairs

    counts = collections.Counter(source for split in pairs.values() for source, _ in split)
    expected = {f"{lang} {n}" for lang in LANGS for n in range(MAX_NUMBER + 1)}
    assert set(counts) == expected
    assert all(c == 1 for c in counts.values()), "an item is in more than one split"

    total = len(expected)
    assert len(pairs["validation"]) == round(0.05 * total)
    assert len(pairs["test"]) == round(0.05 * total)
    train_sources = {s for s, _ in pairs["train"]}
    assert not train_sources & {s for s, _ in pairs["validation"] + pairs["test"]}
    # Splits mix languages rather than holding whole languages out.
    assert {s.split()[0] for s, _ in pairs["validation"]} == set(LANGS)


def test_generate_pairs_seed_changes_split(pairs):
    other = numbers.generate_pairs(**{**SPLIT_ARGS, "seed": 1})
    assert set(other["validation"]) != set(pairs["validation"])
    assert sorted(other["train"] + other["validation"] + other["test"]) == sorted(
        pairs["train"] + pairs["validation"] + pairs["test"]
    )


def test_targets_are_words():
    split = numbers.generate_pairs(["de", "fr", "en"], 99, 0, 0.0, 0.0)["train"]
    table = dict(split)
    assert table["de 21"] == "einundzwanzig"
    assert table["fr 97"] == "quatre-vingt-dix-sept"
    assert table["en 42"] == "forty-two"


def test_generate_pairs_validates_arguments():
    with pytest.raises(ValueError, match=r"'xx'.*supported languages:.*\bde\b"):
        numbers.generate_pairs(["en", "xx"], 10, 0, 0.1, 0.1)
    with pytest.raises(ValueError, match="valid_fraction"):
        numbers.generate_pairs(["en"], 10, 0, -0.1, 0.1)
    with pytest.raises(ValueError, match="< 1"):
        numbers.generate_pairs(["en"], 10, 0, 0.5, 0.5)
    with pytest.raises(ValueError, match="max_number"):
        numbers.generate_pairs(["en"], -1, 0, 0.1, 0.1)
    with pytest.raises(TypeError):
        numbers.generate_pairs("en", 10, 0, 0.1, 0.1)


def test_numbers_below_the_threshold_are_never_held_out():
    args = {**SPLIT_ARGS, "always_train_below": 100}
    split = numbers.generate_pairs(**args)
    held = [s for name in ("validation", "test") for s, _ in split[name]]
    assert held and min(int(s.split()[1]) for s in held) >= 100
    train = {s for s, _ in split["train"]}
    assert {f"{lang} {n}" for lang in LANGS for n in range(100)} <= train
    assert not train & set(held)
    # The fractions apply to the numbers that may be held out: 5% of 3 * 900.
    assert len(split["validation"]) == len(split["test"]) == round(0.05 * 3 * 900)
    # Without the threshold the split is exactly the one made before the option existed.
    assert numbers.generate_pairs(**{**args, "always_train_below": 0}) == numbers.generate_pairs(
        **SPLIT_ARGS
    )


def test_shape_balance_repeats_rarer_shapes_by_its_formula():
    args = {**SPLIT_ARGS, "always_train_below": 100}
    once = numbers.generate_pairs(**args)
    balanced = numbers.generate_pairs(**args, shape_balance=0.5)
    for name in ("validation", "test"):
        assert balanced[name] == once[name]

    def shapes(pairs, lang):
        return collections.Counter(
            numbers.shape(int(s.split()[1])) for s, _ in pairs if s.startswith(lang + " ")
        )

    for lang in LANGS:
        counts, copies = shapes(once["train"], lang), shapes(balanced["train"], lang)
        most = max(counts.values())
        for c, n in counts.items():
            assert copies[c] == n * max(1, round((most / n) ** 0.5))
    assert set(balanced["train"]) == set(once["train"])
    assert numbers.shape(9700) == (4, 2) and numbers.shape(0) == (1, 0)
    assert numbers.shape_repeats([5, 7, 12, 30, 345, 346, 347, 348], 1.0) == {
        (1, 1): 2,
        (2, 2): 4,
        (2, 1): 4,
        (3, 3): 1,
    }
    assert numbers.shape_repeats([5, 12, 345], 0.0) == {(1, 1): 1, (2, 2): 1, (3, 3): 1}


def test_drawn_numbers_are_distinct_seeded_and_split_like_the_others():
    args = dict(
        languages=("en", "de"), max_number=10**9, seed=4, valid_fraction=0.1, test_fraction=0.1
    )
    split = numbers.generate_pairs(**args, always_train_below=10, num_numbers=500)
    assert split == numbers.generate_pairs(**args, always_train_below=10, num_numbers=500)
    sources = [s for name in split for s, _ in split[name]]
    assert len(sources) == len(set(sources)) == 2 * 500 + 2 * 10
    assert [len(split[name]) for name in ("validation", "test")] == [100, 100]
    held = [int(s.split()[1]) for name in ("validation", "test") for s, _ in split[name]]
    assert min(held) >= 10 and max(held) > 10**8  # uniform over 10..10^9
    other = numbers.generate_pairs(**{**args, "seed": 5}, always_train_below=10, num_numbers=500)
    assert split["test"] != other["test"]
    with pytest.raises(ValueError, match="num_numbers=12 exceeds the 11 numbers"):
        numbers.generate_pairs(["en", "de"], 20, 0, 0.1, 0.1, 10, 0.0, 12)


def test_balanced_split_round_trips_through_tfds(tmp_path):
    args = {**SPLIT_ARGS, "max_number": 120, "always_train_below": 100, "shape_balance": 1.0}
    data = numbers.load_number_words(str(tmp_path), **args)
    expected = numbers.generate_pairs(**args)
    for split in ("train", "validation", "test"):
        assert _decoded(data[split]) == expected[split]
    name = numbers.NumberWordsConfig(**args).name
    assert name == "en-de-fr_120_s0_v0.05_t0.05_a100_sb1"


def test_config_name_is_deterministic():
    config = numbers.NumberWordsConfig(**SPLIT_ARGS)
    assert config.name == "en-de-fr_999_s0_v0.05_t0.05"
    assert numbers.NumberWordsConfig(**SPLIT_ARGS).name == config.name
    assert numbers.NumberWordsConfig(**{**SPLIT_ARGS, "seed": 3}).name != config.name


# ---------------------------------------------------------------------------------------------
# numbers.load_number_words (TFDS)


def _decoded(source) -> list[tuple[str, str]]:
    return list(zip(pipeline.texts(source, "source"), pipeline.texts(source, "target")))


def test_tfds_round_trip_and_reuse(tmp_path, pairs, monkeypatch):
    data = numbers.load_number_words(str(tmp_path), **SPLIT_ARGS)
    assert set(data) == {"train", "validation", "test"}
    for split, expected in pairs.items():
        assert len(data[split]) == len(expected)
        # Same content in the same (seeded permutation) order.
        assert _decoded(data[split]) == expected
    item = data["validation"][0]
    assert isinstance(item["source"], bytes) and isinstance(item["target"], bytes)

    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert any("array_record" in f for f in files)
    mtimes = {f: os.stat(f).st_mtime_ns for f in files}

    # A second load must only open the prepared files: generating again would fail here.
    def fail(*args, **kwargs):
        raise AssertionError("dataset was generated again")

    monkeypatch.setattr(numbers.NumberWords, "_split_generators", fail)
    again = numbers.load_number_words(str(tmp_path), **SPLIT_ARGS)
    assert _decoded(again["test"]) == pairs["test"]
    files_after = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert {f: os.stat(f).st_mtime_ns for f in files_after} == mtimes


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_reserved_ids(tokenizer):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    pieces = [tokenizer.id_to_piece(i) for i in range(4)]
    assert pieces == ["<pad>", "<unk>", "<s>", "</s>"]
    assert 50 < tokenizer.vocab_size <= 400
    assert EOS_ID not in tokenizer.encode("en 12") and BOS_ID not in tokenizer.encode("en 12")


def test_round_trip_on_validation_targets(tokenizer, pairs):
    train_chars = set("".join(s + t for s, t in pairs["train"]))
    covered = 0
    for source, target in pairs["validation"]:
        for text in (source, target):
            ids = tokenizer.encode(text)
            if set(text) <= train_chars:
                assert tokenizer.decode(ids) == text
                assert UNK_ID not in ids
                covered += 1
            else:
                # e.g. "zéro" when "fr 0" is held out: the unseen character becomes UNK.
                assert UNK_ID in ids
    assert covered >= 2 * len(pairs["validation"]) - 2


def test_digits_are_split(tokenizer):
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode("de 4721")]
    assert [p.lstrip("▁") for p in pieces if p.lstrip("▁")][-4:] == ["4", "7", "2", "1"]


def test_unknown_characters_become_unk_and_leave_the_rest_intact(tokenizer):
    known = tokenizer.encode("en 12")
    boundary = tokenizer.encode("en 12 en")[len(known)]  # the word-boundary piece "▁"
    ids = tokenizer.encode("en 12 日本☃")
    # The known prefix keeps its ids; the run of unseen characters is one UNK after the
    # boundary, and the pieces say which characters it stands for.
    assert ids == [*known, boundary, UNK_ID]
    known_pieces = tokenizer.encode_with_pieces("en 12")[1]
    assert tokenizer.encode_with_pieces("en 12 日本☃") == (ids, [*known_pieces, "▁", "日本☃"])
    assert tokenizer.decode(ids).split() == ["en", "12", "⁇"]


def test_training_is_deterministic(pairs, tokenizer):
    train = pairs["train"]
    again = Tokenizer.train([s for s, _ in train] + [t for _, t in train], vocab_size=400)
    assert again.to_bytes() == tokenizer.to_bytes()


def test_oversized_vocab_is_accepted():
    tok = Tokenizer.train(["one two three", "four five"] * 5, vocab_size=5000)
    assert 4 < tok.vocab_size < 5000
    assert tok.decode(tok.encode("one five")) == "one five"


def test_save_load_and_pickle(tmp_path, tokenizer):
    path = tmp_path / "spm.model"
    tokenizer.save(path)
    assert os.listdir(tmp_path) == ["spm.model"]  # No temporary file left behind.
    loaded = Tokenizer.load(path)
    assert loaded.to_bytes() == tokenizer.to_bytes()
    assert loaded.encode("fr 97") == tokenizer.encode("fr 97")
    tokenizer.save(path)  # Overwriting works.
    assert Tokenizer.load(path) == tokenizer
    assert pickle.loads(pickle.dumps(tokenizer)).encode("de 3") == tokenizer.encode("de 3")


def test_decode_stops_at_eos_and_skips_pad_bos(tokenizer):
    ids = tokenizer.encode("en 7")
    noisy = [BOS_ID, *ids[:1], PAD_ID, *ids[1:], EOS_ID, *tokenizer.encode("de 9"), EOS_ID]
    assert tokenizer.decode(noisy) == "en 7"
    assert tokenizer.decode(np.array(noisy, dtype=np.int32)) == "en 7"
    assert tokenizer.decode([EOS_ID, *ids]) == ""


def test_encode_many_equals_one_at_a_time(tokenizer):
    """The threaded list path (whole splits) gives the ids of `encode`, in order, across
    chunk boundaries."""
    texts = [f"{lang} {n}" for n in range(0, 3000, 7) for lang in ("en", "de", "fr")] + [""]
    want = [tokenizer.encode(t) for t in texts]
    assert tokenizer.encode_many(texts, chunk=97) == want
    assert tokenizer.encode_many(texts) == want
    assert tokenizer.encode_many([]) == []


def test_encode_batch(tokenizer):
    texts = ["en 5", "quatre-vingt-dix-sept", ""]
    short = tokenizer.encode(texts[0])
    long = tokenizer.encode(texts[1])
    max_len = len(short) + 2
    assert len(long) + 1 > max_len

    ids, num_truncated = tokenizer.encode_batch(texts, max_len)
    assert ids.dtype == np.int32 and ids.shape == (3, max_len)
    assert num_truncated == 1
    assert ids[0].tolist() == short + [EOS_ID, PAD_ID]
    assert ids[1].tolist() == long[: max_len - 1] + [EOS_ID]
    assert ids[2].tolist() == [EOS_ID] + [PAD_ID] * (max_len - 1)
    assert tokenizer.decode_batch(ids)[0] == "en 5"

    ids, num_truncated = tokenizer.encode_batch(texts, max_len, add_eos=False)
    assert num_truncated == 1
    assert ids[0].tolist() == short + [PAD_ID, PAD_ID]
    assert ids[1].tolist() == long[:max_len]
    assert ids[2].tolist() == [PAD_ID] * max_len

    # An exact fit (ids + EOS == max_len) is not a truncation.
    _, num_truncated = tokenizer.encode_batch([texts[0]], len(short) + 1)
    assert num_truncated == 0
    empty, num_truncated = tokenizer.encode_batch([], 4)
    assert empty.shape == (0, 4) and num_truncated == 0


# ---------------------------------------------------------------------------------------------
# Pipeline


def _make(source, tok, **overrides):
    kwargs = {
        "batch_size": 16,
        "max_source_len": 8,
        "max_target_len": 32,
        "seed": 0,
        "shuffle": True,
        "repeat": False,
        "drop_remainder": False,
        **overrides,
    }
    return pipeline.make_dataset(source, tok, **kwargs)


def _valid_rows(batch, tok) -> list[tuple[str, str]]:
    sources = tok.decode_batch(batch["inputs"][batch["valid"]])
    targets = tok.decode_batch(batch["targets"][batch["valid"]])
    return list(zip(sources, targets))


def test_batches_have_fixed_shapes(small_source, small_tokenizer):
    ds = _make(small_source, small_tokenizer)
    batches = list(ds)
    assert len(batches) == len(ds) == 7  # ceil(100 / 16)
    for batch in batches:
        assert set(batch) == {"inputs", "targets", "valid"}
        assert batch["inputs"].shape == (16, 8) and batch["inputs"].dtype == np.int32
        assert batch["targets"].shape == (16, 32) and batch["targets"].dtype == np.int32
        assert batch["valid"].shape == (16,) and batch["valid"].dtype == bool


def test_each_example_once_per_epoch(small_source, small_tokenizer):
    expected = sorted((ex["source"], ex["target"]) for ex in small_source)
    ds = _make(small_source, small_tokenizer)
    seen = [row for batch in ds for row in _valid_rows(batch, small_tokenizer)]
    assert sorted(seen) == expected
    # Shuffled: not the source order.
    assert seen != [(ex["source"], ex["target"]) for ex in small_source]
    # Same seed, same order; another seed, another order.
    assert [
        row for b in _make(small_source, small_tokenizer) for row in _valid_rows(b, small_tokenizer)
    ] == seen
    other = [
        r
        for b in _make(small_source, small_tokenizer, seed=1)
        for r in _valid_rows(b, small_tokenizer)
    ]
    assert other != seen and sorted(other) == expected


def test_repeat_reshuffles_each_epoch(small_source, small_tokenizer):
    ds = _make(small_source, small_tokenizer, batch_size=20, repeat=True)
    rows = [row for step in range(10) for row in _valid_rows(ds[step], small_tokenizer)]
    epoch0, epoch1 = rows[:100], rows[100:]
    expected = sorted((ex["source"], ex["target"]) for ex in small_source)
    assert sorted(epoch0) == expected and sorted(epoch1) == expected
    assert epoch0 != epoch1
    assert all(ds[step]["valid"].all() for step in range(10))


def test_random_access_matches_iteration(small_source, small_tokenizer):
    ds = _make(small_source, small_tokenizer, batch_size=12, repeat=True)
    iterator = iter(ds)
    iterated = [next(iterator) for _ in range(20)]  # Crosses two epoch boundaries.
    for step in (0, 7, 8, 9, 19):
        for key in ("inputs", "targets", "valid"):
            np.testing.assert_array_equal(ds[step][key], iterated[step][key])
    # Resuming from step 9 with a fresh pipeline gives the same continuation.
    resumed = _make(small_source, small_tokenizer, batch_size=12, repeat=True).iter_from(9)
    for step in range(9, 12):
        np.testing.assert_array_equal(next(resumed)["inputs"], iterated[step]["inputs"])


def test_final_partial_batch_is_padded(small_source, small_tokenizer):
    ds = _make(small_source, small_tokenizer, shuffle=False)
    last = ds[len(ds) - 1]
    assert last["valid"].tolist() == [True] * 4 + [False] * 12
    assert (last["inputs"][4:] == PAD_ID).all() and (last["targets"][4:] == PAD_ID).all()
    assert (last["inputs"][:4, 0] != PAD_ID).all()
    assert _valid_rows(last, small_tokenizer) == [
        (ex["source"], ex["target"]) for ex in small_source[96:]
    ]
    dropped = _make(small_source, small_tokenizer, drop_remainder=True)
    assert len(dropped) == 6 and all(dropped[i]["valid"].all() for i in range(6))


def test_truncation_keeps_eos_and_is_counted(small_source, small_tokenizer):
    target_lens = [len(small_tokenizer.encode(ex["target"])) + 1 for ex in small_source]
    max_target_len = 4
    expected = sum(n > max_target_len for n in target_lens)
    assert expected > 0
    assert pipeline.count_truncated(small_source, small_tokenizer, 8, max_target_len) == (
        0,
        expected,
    )
    ds = _make(small_source, small_tokenizer, max_target_len=max_target_len, shuffle=False)
    batch = ds[0]
    for row, length in zip(batch["targets"], target_lens[:16]):
        assert row[min(length, max_target_len) - 1] == EOS_ID


def test_pipeline_reads_tfds_bytes(tmp_path, small_tokenizer):
    # test_fraction=0: TFDS cannot store an empty split, so it comes back as an empty sequence.
    data = numbers.load_number_words(str(tmp_path), ["de"], 99, 1, 0.1, 0.0)
    assert len(data["test"]) == 0 and len(data["validation"]) == 10
    ds = _make(data["validation"], small_tokenizer, batch_size=4)
    seen = [row for batch in ds for row in _valid_rows(batch, small_tokenizer)]
    assert sorted(seen) == sorted(_decoded(data["validation"]))


def test_read_all_reads_in_chunks_and_keeps_the_order():
    from flaxformer_lite.data.examples import read_all

    class Batched(list):
        calls: list = []

        def __getitems__(self, indices):
            self.calls.append(list(indices))
            return [self[i] for i in indices]

    items = Batched({"source": str(i), "target": str(-i)} for i in range(7))
    assert list(read_all(items, chunk=3)) == list(items)
    assert items.calls == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(read_all([{"source": "a"}], chunk=3)) == [{"source": "a"}]  # no __getitems__
    assert list(read_all([])) == []
