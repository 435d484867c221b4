"""The name-copy task: deterministic generation, held-out names, unseen characters, the
loader behind data.dataset="names", and the copy-span scores."""

import math
import re

import pytest

from configs import names as names_config
from flaxformer_lite import datasets
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config import run as run_config
from flaxformer_lite.constants import UNK_ID
from flaxformer_lite.data import batching, names
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.evaluation.copy_spans import copy_scores, verbatim_copies, words

SIZES = dict(num_train=3000, num_valid=200, num_test=300)


@pytest.fixture(scope="module")
def generated():
    return names.generate_names(**SIZES, seed=0)


def _words(examples):
    return {word for e in examples for word in e.span.split()}


def _has_unseen(text):
    return not names.UNSEEN_CHARS.isdisjoint(text)


def test_same_seed_same_examples_other_seed_others(generated):
    assert names.generate_names(**SIZES, seed=0) == generated
    other = names.generate_names(**SIZES, seed=1)
    for split in ("train", "validation", "test"):
        assert other[split] != generated[split]
        assert len({e.span for e in other[split]} & {e.span for e in generated[split]}) < 10


def test_split_sizes(generated):
    assert {s: len(e) for s, e in generated.items()} == {
        "train": 3000,
        "validation": 200,
        "test": 300,
    }
    assert {s: len(e) for s, e in names.generate_names(5, 0, 3).items()} == {
        "train": 5,
        "validation": 0,
        "test": 3,
    }
    for bad in (dict(num_train=0), dict(num_valid=-1), dict(num_test=2.5)):
        with pytest.raises(ValueError):
            names.generate_names(**{**SIZES, **bad})


def test_held_out_names_share_no_word_with_training(generated):
    train_words = _words(generated["train"])
    for split in ("validation", "test"):
        assert train_words.isdisjoint(_words(generated[split])), split


def test_unseen_characters_only_in_half_of_the_held_out_spans(generated):
    for e in generated["train"]:
        assert not _has_unseen(e.source) and not _has_unseen(e.target), e
        assert e.span.isascii()
    for split in ("validation", "test"):
        spans = [e.span for e in generated[split]]
        assert sum(map(_has_unseen, spans)) == len(spans) // 2
        # the unseen characters are in the spans only, never in the templates
        for e in generated[split]:
            assert _has_unseen(e.source) == _has_unseen(e.span) == _has_unseen(e.target)


def test_spans_of_every_kind_in_several_positions(generated):
    spans = [e.span for e in generated["train"]]
    assert any(re.fullmatch(r"[A-Z]{2,3}-\d{3,4}", s) for s in spans)  # codes
    assert any(re.fullmatch(r"[A-Z][a-z]+", s) for s in spans)  # one-word names
    assert any(re.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+", s) for s in spans)  # two words
    positions = {e.source.split().index(e.span.split()[0]) for e in generated["train"]}
    assert {0, 2, 3} <= positions  # first, middle and last words of the sources
    templates = names.NAME_TEMPLATES + names.CODE_TEMPLATES
    assert 6 <= len(templates) <= 10
    for word in names.TEMPLATE_WORDS:
        assert word.isascii() and (word.islower() or not word.isalpha()), word


def test_each_target_repeats_its_source_span(generated):
    for split, examples in generated.items():
        loaded = [{"source": e.source.encode(), "target": e.target.encode()} for e in examples]
        assert names.copied_spans(loaded) == [e.span for e in examples], split
        for e in examples:
            assert names.has_tokens(e.source, e.span) and names.has_tokens(e.target, e.span)
            assert e.source != e.target
    with pytest.raises(ValueError, match="does not repeat"):
        names.copied_span("call me Anna", "nice to meet you , Ann")
    with pytest.raises(ValueError, match="no single span"):
        names.copied_span("call me", "nice to meet you")


def test_a_vocabulary_of_the_training_split_lacks_the_unseen_characters(generated):
    train = generated["train"][:1000]
    tokenizer = Tokenizer.train([e.source for e in train] + [e.target for e in train], 128)
    unseen = next(e for e in generated["test"] if _has_unseen(e.span))
    assert UNK_ID in tokenizer.encode(unseen.source)
    assert all(UNK_ID not in tokenizer.encode(e.source) for e in generated["train"][1000:1100])


def test_load_splits_with_a_data_config(tmp_path):
    config = names_config.get_config()
    config.data.tfds_dir = str(tmp_path / "tfds")
    config.data.names.train, config.data.names.valid, config.data.names.test = 300, 20, 30
    config.data.seed = 3
    splits = datasets.load_splits(run_config.parse(config).data)
    assert {s: len(v) for s, v in splits.items()} == {"train": 300, "validation": 20, "test": 30}
    expected = names.generate_names(300, 20, 30, seed=3)
    for split, examples in splits.items():
        assert all(isinstance(e["source"], bytes) for e in examples)
        assert [e["target"].decode() for e in examples] == [e.target for e in expected[split]]
    # the pipeline reads the lists as any split
    tokenizer = Tokenizer.train([e.source for e in expected["train"]], 96)
    batches = batching.eval_batches(
        splits["test"], tokenizer, batch_size=16, max_source_len=32, max_target_len=32
    )
    assert len(batches) == 2 and batches[0]["inputs"].shape == (16, 32)


def test_names_config_fields_are_checked():
    config = names_config.get_config()
    run = run_config.parse(config)
    assert run.data.dataset == "names" and run.data.names.train == 20_000
    assert not run.data.source_lang  # the generated task needs no languages
    config.data.names.train = 0
    with pytest.raises(ConfigError, match="data.names.train must be a positive integer"):
        run_config.validate(config)


# --- copy-span scores ---

SOURCES = [
    "hi , i am Kuroro",
    "my code is XK-4471 .",
    "call me Anna Lindqvist",
    "call me Žofia",
]
REFERENCES = [
    "hello Kuroro , nice to meet you",
    "thank you , XK-4471 is noted",
    "nice to meet you , Anna Lindqvist",
    "nice to meet you , Žofia",
]


def test_copy_scores_all_right():
    scores = copy_scores(SOURCES, REFERENCES, REFERENCES)
    assert scores == {
        "span_match": 1.0,
        "exact_match": 1.0,
        "unseen_span_match": 1.0,
        "unseen_exact_match": 1.0,
        "examples": 4,
        "unseen_examples": 1,
    }


def test_copy_scores_span_only_as_whole_tokens():
    hypotheses = [
        "hello Kuroro , how are you",  # span right, sentence wrong
        "thank you , XK-4471. is noted",  # the span glued to a dot: no whole token
        "nice to meet you , Anna Lindqvist",  # exact
        "nice to meet you , ⁇ ofia",  # the unseen character lost
    ]
    scores = copy_scores(SOURCES, hypotheses, REFERENCES)
    assert scores["span_match"] == 0.5 and scores["exact_match"] == 0.25
    assert scores["unseen_span_match"] == 0.0 and scores["unseen_exact_match"] == 0.0
    one = copy_scores(SOURCES[2:3], ["nice to meet you , Anna Lindqvistova"], REFERENCES[2:3])
    assert one["span_match"] == 0.0  # a longer token is not the span
    two = copy_scores(SOURCES[2:3], ["Lindqvist Anna"], REFERENCES[2:3])
    assert two["span_match"] == 0.0  # both words, in the wrong order


def test_copy_scores_without_unseen_examples_and_bad_input():
    scores = copy_scores(SOURCES[:2], REFERENCES[:2], REFERENCES[:2])
    assert scores["unseen_examples"] == 0 and math.isnan(scores["unseen_span_match"])
    scores = copy_scores(SOURCES, REFERENCES, REFERENCES, unseen_chars="K")
    assert scores["unseen_examples"] == 2  # Kuroro and XK-4471
    with pytest.raises(ValueError, match="3 sources, 4 hypotheses"):
        copy_scores(SOURCES[:3], REFERENCES, REFERENCES)
    with pytest.raises(ValueError, match="does not repeat"):
        copy_scores(["call me Anna"], ["x"], ["hello you"])


def test_words_strip_punctuation_at_the_ends_only():
    assert words("„Boston-Terrier“, 3. ... ( x") == {"Boston-Terrier", "3", "x"}
    assert words("U.S.A. and 3,5") == {"U.S.A", "and", "3,5"}
    assert words("") == set() and words(" - , ") == set()


EN = [
    "A Boston Terrier is running on the grass.",
    "Two men play in the 2012 Olympics.",
    "A dog runs.",
]
DE = [
    "Ein Boston Terrier läuft über das Gras.",
    "Zwei Männer spielen bei den Olympics 2012.",
    "Ein Hund rennt.",
]


def test_verbatim_copies_counts_shared_words_and_their_repeats():
    # Copyable: {Boston, Terrier} and {2012, Olympics}; the third pair shares nothing.
    right = verbatim_copies(EN, DE, DE)
    assert right == {
        "copyable": 4,
        "reproduced": 4,
        "share": 1.0,
        "name_copyable": 4,
        "name_reproduced": 4,
        "name_share": 1.0,
        "examples": 3,
    }
    hypotheses = [
        "Ein Boston-Terrier läuft , Terrier !",  # "Boston-Terrier" is not "Boston"
        "Zwei Männer spielen bei den olympics 2012",  # case counts: "olympics" misses
        "Boston Terrier",  # not copyable here: words of other examples do not count
    ]
    scores = verbatim_copies(EN, hypotheses, DE)
    assert (scores["copyable"], scores["reproduced"]) == (4, 2)
    assert scores["share"] == 0.5 and scores["name_share"] == 0.5


def test_verbatim_copies_lowercase_words_count_only_in_the_full_share():
    scores = verbatim_copies(["the man in Berlin"], ["in Berlin"], ["der Mann in Berlin"])
    assert (scores["copyable"], scores["reproduced"]) == (2, 2)  # "in" and "Berlin"
    assert (scores["name_copyable"], scores["name_reproduced"]) == (1, 1)
    none = verbatim_copies(["a dog"], ["ein Hund"], ["ein Hund"])
    assert none["copyable"] == 0 and math.isnan(none["share"]) and math.isnan(none["name_share"])


def test_verbatim_copies_missing_words_and_bad_input():
    scores = verbatim_copies(EN[:1], ["Ein Hund läuft über das Gras."], DE[:1])
    assert scores["reproduced"] == 0 and scores["share"] == 0.0  # both names dropped
    with pytest.raises(ValueError, match="2 sources, 3 hypotheses"):
        verbatim_copies(EN[:2], DE, DE)
