"""The spoken-number task: the split by number, the builder's records against direct synthesis,
reuse without a synthesiser, and the one-line errors of its config fields."""

import numpy as np
import pytest

from configs import default
from flaxformer_lite import datasets
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config import run as run_config
from flaxformer_lite.data import speech_synthesis
from flaxformer_lite.data import spoken_numbers as sn

TINY = dict(
    languages=("en", "de"), max_number=99, num_numbers=20, always_train_below=5,
    utterances_per_number=2, num_mels=16, seed=0, valid_fraction=0.2, test_fraction=0.2,
)  # fmt: skip


@pytest.fixture(scope="module")
def tone_splits(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfds")
    splits = sn.load_spoken_numbers(
        root, **TINY, target="digits", synthesize=sn.tones, voice="tones"
    )
    return root, splits


def _number(example):
    return int(example["source"].split()[1])


def test_held_out_numbers_are_never_heard_in_training():
    numbers = sn.split_numbers(999, 100, 20, 3, 0.1, 0.1)
    train, valid, test = (set(numbers[s]) for s in ("train", "validation", "test"))
    assert not (train & valid or train & test or valid & test)
    assert set(range(20)) <= train and len(valid) == len(test) == 10
    assert len(train) == 80 + 20


def test_records_are_the_utterances_synthesised_directly(tone_splits):
    _, splits = tone_splits
    train = splits["train"]
    assert len(train) == (12 + 5) * 2 * 2 and len(splits["validation"]) == 4 * 2
    heard = {_number(e) for e in train}
    for split in ("validation", "test"):
        assert not heard & {_number(e) for e in splits[split]}
    for index in (0, 7, len(train) - 1):
        example = train[index]
        lang, number = example["source"].decode().split()[:2]
        copy = index % 2  # each training number is spoken twice, side by side
        direct = sn.utterance(sn.tones, lang, int(number), copy, 0, 16)
        assert example["features"].dtype == np.float32
        np.testing.assert_array_equal(example["features"], direct["features"].astype(np.float32))
        assert example["target"] == number.encode()  # digits
        assert example["source"] == direct["source"].encode()
    # The two copies of a number differ (voice, rate, pitch and noise are drawn per copy).
    assert train[0]["source"] != train[1]["source"]
    batch = train.__getitems__([0, 2])
    np.testing.assert_array_equal(batch[1]["features"], train[2]["features"])


def test_prepared_data_is_reused_without_synthesis(tone_splits, monkeypatch):
    root, splits = tone_splits

    def fail(*args):
        raise AssertionError("synthesised again")

    again = sn.load_spoken_numbers(root, **TINY, target="words", synthesize=fail, voice="tones")
    assert len(again["train"]) == len(splits["train"])
    example = again["validation"][0]
    from num2words import num2words

    lang = example["source"].decode().split()[0]
    assert example["target"].decode() == num2words(_number(example), lang=lang)


def _speech_config(tfds_dir="", **options):
    """configs/default.py on spoken_numbers, with data.spoken_numbers fields `options`."""
    config = default.get_config()
    config.data.dataset, config.data.tfds_dir = "spoken_numbers", tfds_dir
    config.model.input_features = 80
    for k, v in options.items():
        setattr(config.data.spoken_numbers, k, v)
    return config


def test_without_espeak_the_loader_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(speech_synthesis, "available", lambda: False)
    config = _speech_config(tfds_dir=str(tmp_path), numbers=5)
    parsed = run_config.parse(config)
    with pytest.raises(ConfigError, match=r"spoken_numbers: .*pip install '\.\[speech\]'") as e:
        datasets.load_splits(parsed.data)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(target="letters"), "data.spoken_numbers.target"),
        (dict(numbers=2000), "data.spoken_numbers.numbers=2000"),
        (dict(languages=("en", "xx")), "data.spoken_numbers.languages has 'xx'"),
        (dict(num_mels=40), "model.input_features=80 .* data.spoken_numbers.num_mels=40"),
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        run_config.parse(_speech_config(**change))


@pytest.mark.skipif(not speech_synthesis.available(), reason="no espeak-ng backend")
def test_espeak_utterances(tmp_path):
    splits = sn.load_spoken_numbers(
        tmp_path, languages=("fr",), max_number=30, num_numbers=4, always_train_below=2,
        utterances_per_number=1, num_mels=80, seed=1, valid_fraction=0.25, test_fraction=0.25,
    )  # fmt: skip
    example = splits["validation"][0]
    frames, mels = example["features"].shape
    assert mels == 80 and frames > 20  # at least 0.2 s of speech
    np.testing.assert_allclose(example["features"].mean(axis=0), 0, atol=1e-2)  # CMVN
    assert len(splits["train"]) == 2 + 2
