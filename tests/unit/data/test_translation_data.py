"""Tests of the corpus loaders: data/translation.py, data/tsv_pairs.py and data/catalog.py."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib
from typing import ClassVar

import numpy as np
import pytest
import tensorflow_datasets as tfds

from flaxformer_lite.data import catalog, translation, tsv_pairs
from flaxformer_lite.data.catalog import CatalogError
from flaxformer_lite.data.translation import CorpusError

ROOT = pathlib.Path(__file__).resolve().parents[3]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


def _pairs(source) -> list[tuple[str, str]]:
    """Returns every example of a split source as a decoded ``(source, target)`` tuple."""

    def text(value) -> str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    return [(text(source[i]["source"]), text(source[i]["target"])) for i in range(len(source))]


def _write(path: pathlib.Path, lines: list[str] | bytes) -> None:
    """Writes ``lines`` (UTF-8, gzipped when ``path`` ends in .gz) or raw bytes as they are."""
    if isinstance(lines, bytes):
        path.write_bytes(lines)
        return
    data = "".join(f"{line}\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def _write_corpus(corpus: pathlib.Path, sizes: dict[str, int], gzipped: tuple[str, ...] = ()):
    """Writes aligned ``{split}.{en,de}`` files whose line i reads "{split} {lang} i"."""
    corpus.mkdir(exist_ok=True)
    for split, size in sizes.items():
        for lang in ("en", "de"):
            suffix = ".gz" if split in gzipped else ""
            _write(corpus / f"{split}.{lang}{suffix}", [f"{split} {lang} {i}" for i in range(size)])


def _expected(split: str, size: int) -> list[tuple[str, str]]:
    return [(f"{split} en {i}", f"{split} de {i}") for i in range(size)]


def _leftovers(tfds_dir: pathlib.Path) -> list[str]:
    """Returns paths of unfinished TFDS writes (TFDS writes into "*incomplete*" folders)."""
    return [str(p) for p in tfds_dir.rglob("*") if "incomplete" in p.name]


# ---------------------------------------------------------------------------------------------
# load_parallel_text


def test_parallel_text_round_trip_and_reuse(tmp_path, monkeypatch):
    corpus, tfds_dir = tmp_path / "corpus", tmp_path / "tfds"
    _write_corpus(corpus, {"train": 30, "dev": 20}, gzipped=("dev",))
    logs: list[str] = []

    sources = translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=logs.append)
    assert sorted(sources) == ["dev", "train"]
    assert _pairs(sources["train"]) == _expected("train", 30)
    assert _pairs(sources["dev"]) == _expected("dev", 20)  # Read from .gz files.
    assert any(line.startswith("Preparing") for line in logs)

    # Unchanged corpus: the prepared files are opened, nothing is generated again.
    def fail(*args, **kwargs):
        raise AssertionError("the corpus was prepared a second time")

    monkeypatch.setattr(translation.ParallelText, "_generate_examples", fail)
    logs.clear()
    again = translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=logs.append)
    assert _pairs(again["train"]) == _expected("train", 30)
    assert logs[0].startswith("Reusing")
    monkeypatch.undo()

    # A changed file changes the fingerprint, so the corpus is prepared again.
    _write_corpus(corpus, {"train": 31})
    changed = translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=logs.append)
    assert _pairs(changed["train"]) == _expected("train", 31)
    assert len(list((tfds_dir / "parallel_text").iterdir())) == 2


def test_parallel_text_line_endings_empty_pairs_and_file_choice(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # BOM and CRLF are removed; inner whitespace is kept; pairs with an empty side are skipped.
    _write(corpus / "train.en", "\ufeffa b\r\n\nc \r\n  \nlast".encode())
    _write(corpus / "train.de", b"A B\r\nX\r\n\r\nY\nLAST\n")
    _write(corpus / "train.en.gz", ["ignored"] * 5)  # The plain file wins over the .gz one.
    _write(corpus / "other.fr", ["no de counterpart"])
    logs: list[str] = []
    sources = translation.load_parallel_text(
        corpus, "en", "de", tfds_dir=tmp_path / "tfds", log=logs.append
    )
    assert list(sources) == ["train"]
    assert _pairs(sources["train"]) == [("a b", "A B"), ("  ", "Y"), ("last", "LAST")]
    assert any("train: 3 pairs, 2 skipped" in line for line in logs)


def test_parallel_text_explicit_splits(tmp_path):
    corpus = tmp_path / "corpus"
    _write_corpus(corpus, {"train": 5, "val": 3, "test": 2})
    sources = translation.load_parallel_text(
        corpus, "en", "de", tfds_dir=tmp_path / "tfds", splits=["val", "test"], log=lambda _: None
    )
    assert list(sources) == ["val", "test"]
    assert [len(sources[s]) for s in sources] == [3, 2]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        pytest.param(
            {"train.en": ["a"] * 5, "train.de": ["b"] * 4},
            r"train\.en has 5 lines but train\.de has 4; the files of a split must be line-aligned",
            id="mismatched",
        ),
        pytest.param({"train.en": ["a"] * 5, "train.de": b""}, r"train\.de is empty", id="empty"),
        pytest.param(
            {"train.en": ["a"] * 5, "train.de": b"b\nb\nb \xff\xfe\nb\nb\n"},
            r"train\.de line 3 is not valid UTF-8.*re-encode",
            id="invalid_utf8",
        ),
        pytest.param(
            {"train.en": ["a"] * 5, "train.de.gz": gzip.compress(b"b\n" * 5)[:-6]},
            r"Could not read .*train\.de\.gz",
            id="truncated_gz",
        ),
        pytest.param(
            {"train.en": ["a", ""], "train.de": ["", "b"]}, "has an empty side", id="all_empty"
        ),
    ],
)
def test_parallel_text_bad_corpus(tmp_path, files, message):
    corpus, tfds_dir = tmp_path / "corpus", tmp_path / "tfds"
    corpus.mkdir()
    for file_name, content in files.items():
        _write(corpus / file_name, content)
    with pytest.raises(CorpusError, match=message):
        translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=lambda _: None)
    # The corpus is checked before anything is written.
    assert not _leftovers(tfds_dir) and not list(tfds_dir.rglob("*.array_record*"))
    for path in corpus.iterdir():
        path.unlink()
    _write_corpus(corpus, {"train": 4})
    sources = translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=print)
    assert _pairs(sources["train"]) == _expected("train", 4)


def test_parallel_text_missing_files(tmp_path):
    corpus = tmp_path / "corpus"
    _write_corpus(corpus, {"train": 3})
    _write(corpus / "test.en", ["a"])
    with pytest.raises(CorpusError, match=r"neither test\.de nor test\.de\.gz .*found: test\.en"):
        translation.load_parallel_text(
            corpus, "en", "de", tfds_dir=tmp_path / "tfds", splits=["train", "test"]
        )
    with pytest.raises(CorpusError, match=r"No split .* has both a \.en and a \.fr file"):
        translation.load_parallel_text(corpus, "en", "fr", tfds_dir=tmp_path / "tfds")
    with pytest.raises(CorpusError, match="does not exist"):
        translation.load_parallel_text(tmp_path / "nowhere", "en", "de", tfds_dir=tmp_path)


def test_parallel_text_failure_while_writing_leaves_nothing_behind(tmp_path, monkeypatch):
    corpus, tfds_dir = tmp_path / "corpus", tmp_path / "tfds"
    _write_corpus(corpus, {"train": 10})
    original = translation.ParallelText._generate_examples

    def interrupted(self, *paths):
        for i, example in enumerate(original(self, *paths)):
            if i == 5:
                raise KeyboardInterrupt("simulated interruption while writing")
            yield example

    monkeypatch.setattr(translation.ParallelText, "_generate_examples", interrupted)
    with pytest.raises(KeyboardInterrupt):
        translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=lambda _: None)
    monkeypatch.undo()
    assert not _leftovers(tfds_dir)
    sources = translation.load_parallel_text(corpus, "en", "de", tfds_dir=tfds_dir, log=print)
    assert _pairs(sources["train"]) == _expected("train", 10)


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")
def test_multi30k(tmp_path):
    sources = translation.load_parallel_text(
        MULTI30K, "en", "de", tfds_dir=tmp_path, splits=["train", "val", "test_2016_flickr"]
    )
    assert {split: len(source) for split, source in sources.items()} == {
        "train": 29000,
        "val": 1014,
        "test_2016_flickr": 1000,
    }
    first_en = (MULTI30K / "val.en").read_text(encoding="utf-8").splitlines()[0]
    first_de = (MULTI30K / "val.de").read_text(encoding="utf-8").splitlines()[0]
    assert _pairs(sources["val"])[0] == (first_en, first_de)


# ---------------------------------------------------------------------------------------------
# split_line_indices and load_tsv_pairs


def test_split_line_indices_is_seeded_disjoint_and_complete():
    kwargs = {"seed": 3, "valid_fraction": 0.1, "test_fraction": 0.05}
    indices = tsv_pairs.split_line_indices(1000, **kwargs)
    again = tsv_pairs.split_line_indices(1000, **kwargs)
    assert all(np.array_equal(indices[s], again[s]) for s in tsv_pairs.TSV_SPLITS)
    other = tsv_pairs.split_line_indices(1000, **{**kwargs, "seed": 4})
    assert not np.array_equal(indices["validation"], other["validation"])
    assert [len(indices[s]) for s in ("validation", "test", "train")] == [100, 50, 850]
    assert np.array_equal(np.sort(np.concatenate(list(indices.values()))), np.arange(1000))
    assert all(np.all(np.diff(ids) > 0) for ids in indices.values())  # File order.
    with pytest.raises(ValueError, match="valid_fraction"):
        tsv_pairs.split_line_indices(10, seed=0, valid_fraction=0.6, test_fraction=0.4)


def test_tsv_pairs_split_columns_and_skips(tmp_path):
    path, tfds_dir = tmp_path / "pairs.tsv", tmp_path / "tfds"
    # A third (attribution) column is ignored; lines 7 (blank) and 9 (empty target) are skipped.
    lines = [f"en {i}\tfr {i}\tCC-BY 2.0 (France) #{i}" for i in range(200)]
    lines[6], lines[8] = "", "en 8\t\tCC-BY 2.0 (France) #8"
    _write(path, lines)
    kwargs = {"seed": 7, "valid_fraction": 0.1, "test_fraction": 0.2}
    logs: list[str] = []
    sources = tsv_pairs.load_tsv_pairs(path, tfds_dir=tfds_dir, log=logs.append, **kwargs)
    expected = tsv_pairs.split_line_indices(200, **kwargs)
    for split in tsv_pairs.TSV_SPLITS:
        kept = [i for i in expected[split] if i not in (6, 8)]
        assert _pairs(sources[split]) == [(f"en {i}", f"fr {i}") for i in kept]
        skipped = len(expected[split]) - len(kept)
        assert f"  {split}: {len(kept)} pairs, {skipped} skipped (empty)" in logs

    reversed_ = tsv_pairs.load_tsv_pairs(
        path, tfds_dir=tfds_dir, source_column=1, target_column=0, log=logs.append, **kwargs
    )
    assert _pairs(reversed_["test"]) == [(t, s) for s, t in _pairs(sources["test"])]
    attribution = tsv_pairs.load_tsv_pairs(
        path, tfds_dir=tfds_dir, target_column=2, log=logs.append, **kwargs
    )
    assert all(t.startswith("CC-BY 2.0 (France) #") for _, t in _pairs(attribution["train"]))


def test_tsv_pairs_zero_fraction_gives_empty_split(tmp_path):
    path = tmp_path / "pairs.tsv"
    _write(path, [f"s{i}\tt{i}" for i in range(20)])
    sources = tsv_pairs.load_tsv_pairs(
        path, tfds_dir=tmp_path / "tfds", valid_fraction=0.0, test_fraction=0.25, log=print
    )
    assert [len(sources[s]) for s in tsv_pairs.TSV_SPLITS] == [15, 0, 5]
    assert sources["validation"] == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"a\tb\nc\td\nonly one field\n",
            r"pairs\.tsv line 3 has 1 tab-separated field\(s\) but 2",
        ),
        (b"a\tb\nc\t\xe9t\xe9\n", r"pairs\.tsv line 2 is not valid UTF-8"),
        (b"", r"is empty"),
    ],
)
def test_tsv_pairs_bad_file(tmp_path, content, message):
    path, tfds_dir = tmp_path / "pairs.tsv", tmp_path / "tfds"
    _write(path, content)
    with pytest.raises(CorpusError, match=message):
        tsv_pairs.load_tsv_pairs(path, tfds_dir=tfds_dir, log=print)
    assert not _leftovers(tfds_dir)


# ---------------------------------------------------------------------------------------------
# load_catalog


@pytest.fixture
def without_tensorflow_check(monkeypatch):
    """Lets load_catalog reach `download_and_prepare` (mocked by the tests) without TensorFlow."""
    monkeypatch.setattr(catalog, "_require_tensorflow", lambda name: None)


@pytest.mark.parametrize(
    ("name", "source_lang", "target_lang"),
    [("wmt14_translate/de-en", "de", "en"), ("ted_hrlr_translate/pt_to_en", "pt", "en")],
)
def test_catalog_with_tfds_mock_data(
    tmp_path, without_tensorflow_check, name, source_lang, target_lang
):
    with tfds.testing.mock_data(num_examples=5, policy=tfds.testing.MockPolicy.USE_CODE):
        sources = catalog.load_catalog(
            name,
            source_lang=source_lang,
            target_lang=target_lang,
            tfds_dir=tmp_path,
            splits=["train", "validation"],  # Mocked builders list no splits of their own.
        )
        assert {split: len(source) for split, source in sources.items()} == {
            "train": 5,
            "validation": 5,
        }
        record = sources["train"][0]
        assert set(record) == {"source", "target"} and record["source"] != record["target"]


class FakeTranslate(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Stands in for a prepared catalog dataset: Translation features keyed by language."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Test data."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.Translation(languages=("de", "en")),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(6), "test": self._generate_examples(2)}

    def _generate_examples(self, size):
        for i in range(size):
            yield i, {"de": f"Satz {i}", "en": f"sentence {i}"}


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch) -> pathlib.Path:
    """Prepares FakeTranslate in array_record under tmp_path and serves it as "fake/de-en"."""
    tfds_dir = tmp_path / "tfds"
    FakeTranslate(data_dir=str(tfds_dir), file_format="array_record").download_and_prepare()
    monkeypatch.setattr(tfds, "builder", lambda name, data_dir: FakeTranslate(data_dir=data_dir))
    return tfds_dir


def test_catalog_adapter_on_prepared_array_record(fake_catalog):
    sources = catalog.load_catalog(
        "fake/de-en", source_lang="en", target_lang="de", tfds_dir=fake_catalog, download=False
    )
    assert {split: len(source) for split, source in sources.items()} == {"train": 6, "test": 2}
    assert _pairs(sources["train"])[4] == ("sentence 4", "Satz 4")
    batch = sources["train"].__getitems__([5, 0])
    assert [record["target"] for record in batch] == [b"Satz 5", b"Satz 0"]
    only_test = catalog.load_catalog(
        "fake/de-en", source_lang="de", target_lang="en", tfds_dir=fake_catalog, splits=["test"]
    )
    assert _pairs(only_test["test"]) == [("Satz 0", "sentence 0"), ("Satz 1", "sentence 1")]


def test_catalog_prepared_as_tfrecord_is_explained(fake_catalog):
    # Data prepared by a default `download_and_prepare` is tfrecord, which has no random access.
    (info_path,) = fake_catalog.rglob("dataset_info.json")
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "fileFormat": "tfrecord"}))
    with pytest.raises(CatalogError, match=r"as tfrecord files.*file_format='array_record'"):
        catalog.load_catalog(
            "fake/de-en", source_lang="de", target_lang="en", tfds_dir=fake_catalog
        )


def test_catalog_names_and_features_are_checked(tmp_path):
    with pytest.raises(CatalogError, match=r"no feature 'fr'; its features are \['de', 'en'\]"):
        catalog.load_catalog(
            "wmt14_translate/de-en", source_lang="fr", target_lang="en", tfds_dir=tmp_path
        )
    with pytest.raises(CatalogError, match="No TFDS catalog dataset 'no_such_dataset/x'"):
        catalog.load_catalog(
            "no_such_dataset/x", source_lang="a", target_lang="b", tfds_dir=tmp_path
        )
    with pytest.raises(CatalogError, match="not prepared .* pass download=True"):
        catalog.load_catalog(
            "wmt14_translate/de-en",
            source_lang="de",
            target_lang="en",
            tfds_dir=tmp_path,
            download=False,
        )


@pytest.mark.skipif(HAS_TENSORFLOW, reason="checks the message shown when TensorFlow is absent")
def test_catalog_needs_tensorflow_to_prepare(tmp_path):
    with pytest.raises(CatalogError, match=r'pip install -e "\.\[tf\]".*load_parallel_text'):
        catalog.load_catalog(
            "ted_hrlr_translate/pt_to_en", source_lang="pt", target_lang="en", tfds_dir=tmp_path
        )


@pytest.mark.parametrize(
    "error",
    [
        tfds.download.DownloadError("Failed to get url"),
        ConnectionError("Name or service not known"),
    ],
)
def test_catalog_download_failure_points_to_local_loaders(
    tmp_path, monkeypatch, without_tensorflow_check, error
):
    def offline(self, **kwargs):
        raise error

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", offline)
    with pytest.raises(CatalogError, match="could not be downloaded") as raised:
        catalog.load_catalog(
            "ted_hrlr_translate/pt_to_en", source_lang="pt", target_lang="en", tfds_dir=tmp_path
        )
    assert "load_parallel_text" in str(raised.value) and "load_tsv_pairs" in str(raised.value)
    assert raised.value.__cause__ is error
