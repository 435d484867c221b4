"""Line-aligned translation corpora as splits, and what every local corpus builder shares.

Every loader returns ``{split: source}``, each source a random-access sequence of
``{"source": bytes, "target": bytes}`` (UTF-8) read from ``array_record`` files:

* :func:`load_parallel_text` (here): line-aligned ``{split}.{lang}[.gz]`` files (e.g. Multi30k);
* ``tsv_pairs.load_tsv_pairs``: a tab-separated file of pairs (e.g. Anki's ``fra.txt``), seeded
  split;
* ``catalog.load_catalog``: a TFDS catalog dataset such as ``wmt14_translate/de-en`` (preparing
  it needs network access and TensorFlow; reading prepared ``array_record`` data does not).

The local builders need no TensorFlow. They check the whole corpus before writing anything, and
their config name holds a fingerprint (path, size, mtime) of the input files, so an edited
corpus is prepared again instead of stale data being reused.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import tensorflow_datasets as tfds

from flaxformer_lite.data._tfds import SKIPPED_KEY, Log, PairsBuilder, prepare

# TFDS names its files "{dataset}-{split}.array_record-...", so a split must be a single word.
_WORD = re.compile(r"\w+", re.ASCII)


class CorpusError(ValueError):
    """A local corpus is missing, empty, misaligned, malformed or not valid UTF-8."""


def read_lines(path: str) -> Iterator[str]:
    """Yields the lines of a plain or gzipped (``.gz``) UTF-8 file.

    Only the line ending (``\\n`` or ``\\r\\n``) and a UTF-8 byte-order mark at the start of the
    file are removed; other whitespace is part of the text.
    """
    name = os.path.basename(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CorpusError(
                        f"{name} line {number} is not valid UTF-8 ({e.reason} at byte {e.start} "
                        f"of the line) in {path}; re-encode the file as UTF-8, e.g. "
                        f"`iconv -f LATIN1 -t UTF-8 {name} > {name}.utf8`"
                    ) from None
                if number == 1:
                    # Editors on Windows often write a BOM; it is no part of the first sentence.
                    line = line.removeprefix("\ufeff")
                yield line.removesuffix("\n").removesuffix("\r")
    except (OSError, EOFError) as e:  # gzip raises EOFError for a truncated archive.
        raise CorpusError(
            f"Could not read {path}: {e}; check that the file is readable and, for .gz, a "
            "complete gzip archive"
        ) from e


def files_fingerprint(paths: Sequence[str]) -> str:
    """Returns 10 hex digits that change when any of ``paths`` is moved, resized or touched."""
    digest = hashlib.sha256()
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:10]


def safe_name(text: str) -> str:
    """Returns ``text`` reduced to ``[A-Za-z0-9_]`` for use in a config (directory) name."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "corpus"


class ParallelTextConfig(tfds.core.BuilderConfig):
    """Config of :class:`ParallelText`: the corpus directory, languages and splits.

    ``splits`` defaults to every split ``s`` with both ``s.{source_lang}`` and
    ``s.{target_lang}`` present, plain or ``.gz`` (the plain file wins when both exist). The
    ``name`` holds the directory name, the language pair and a fingerprint of the chosen files.
    """

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike,
        source_lang: str,
        target_lang: str,
        splits: Sequence[str] | None = None,
    ) -> None:
        data_dir = os.path.abspath(os.fspath(data_dir))
        langs = (source_lang, target_lang)
        _check_corpus_dir(data_dir, langs)
        names = sorted(os.listdir(data_dir))
        # Errors list what is there, as that usually shows the mistake (a typo, a .txt suffix).
        found = ", ".join(names[:30]) + (f", ... ({len(names)} files)" if len(names) > 30 else "")
        if splits is None:
            splits = _discover_splits(data_dir, names, langs, found)
        splits = _check_split_names(splits)
        self.files: dict[str, tuple[str, str]] = {
            split: _split_files(data_dir, split, langs, found) for split in splits
        }
        fingerprint = files_fingerprint([path for pair in self.files.values() for path in pair])
        super().__init__(
            name=f"{safe_name(os.path.basename(data_dir))}_{source_lang}-{target_lang}_"
            f"{fingerprint}",
            version=tfds.core.Version("1.0.0"),
            description=f"{source_lang}->{target_lang} pairs of splits {splits} of {data_dir}.",
        )
        self.source_lang = source_lang
        self.target_lang = target_lang
        self.splits = splits


def _check_corpus_dir(data_dir: str, langs: tuple[str, str]) -> None:
    """Raises unless ``data_dir`` exists and ``langs`` are two different single-word codes."""
    if not os.path.isdir(data_dir):
        raise CorpusError(
            f"Corpus directory {data_dir} does not exist; pass the directory that holds the "
            "{split}.{lang} files"
        )
    source_lang, target_lang = langs
    if not (_WORD.fullmatch(source_lang) and _WORD.fullmatch(target_lang)) or (
        source_lang == target_lang
    ):
        raise ValueError(f"Need two different language codes, got {source_lang!r}, {target_lang!r}")


def _discover_splits(
    data_dir: str, names: Sequence[str], langs: tuple[str, str], found: str
) -> list[str]:
    """The splits ``s`` of ``names`` with both ``s.{lang}`` files, plain or ``.gz``, sorted."""
    found_splits = []
    for lang in langs:
        pattern = re.compile(rf"(.+)\.{re.escape(lang)}(\.gz)?")
        found_splits.append({m.group(1) for m in map(pattern.fullmatch, names) if m})
    splits = sorted(found_splits[0] & found_splits[1])
    if not splits:
        source_lang, target_lang = langs
        raise CorpusError(
            f"No split of {data_dir} has both a .{source_lang} and a .{target_lang} file "
            f"(e.g. train.{source_lang} and train.{target_lang}); found: {found or '-'}"
        )
    return splits


def _check_split_names(splits: Sequence[str]) -> tuple[str, ...]:
    """``splits`` as a non-empty tuple of distinct names."""
    if isinstance(splits, str):
        raise TypeError(f"splits must be a sequence of names, not the string {splits!r}")
    splits = tuple(splits)
    if not splits or len(set(splits)) != len(splits):
        raise ValueError(f"splits must be non-empty and without duplicates, got {splits}")
    return splits


def _split_files(data_dir: str, split: str, langs: tuple[str, str], found: str) -> tuple[str, str]:
    """The (source, target) files of ``split``; the plain file wins over its ``.gz``."""
    if not _WORD.fullmatch(split):
        raise CorpusError(
            f"Split name {split!r} must contain only letters, digits and '_' (TFDS puts "
            "it in file names); rename its files or pass other splits="
        )
    paths = []
    for lang in langs:
        candidates = [os.path.join(data_dir, f"{split}.{lang}{gz}") for gz in ("", ".gz")]
        existing = [path for path in candidates if os.path.isfile(path)]
        if not existing:
            raise CorpusError(
                f"Split {split!r} has no {lang} file: neither {split}.{lang} nor "
                f"{split}.{lang}.gz is in {data_dir}; found: {found or '-'}. Add the "
                "file or pass other splits="
            )
        paths.append(existing[0])
    return paths[0], paths[1]


def _check_aligned(source_path: str, target_path: str) -> int:
    """Reads both files of a split once, checking they are non-empty, UTF-8 and line-aligned.

    Returns:
        The number of line pairs with at least one empty side (to be skipped).
    """
    counts = [0, 0]
    kept = skipped = 0
    for source, target in itertools.zip_longest(read_lines(source_path), read_lines(target_path)):
        counts[0] += source is not None
        counts[1] += target is not None
        if source is not None and target is not None:
            kept += bool(source and target)
            skipped += not (source and target)
    names = [os.path.basename(source_path), os.path.basename(target_path)]
    for path, count in zip((source_path, target_path), counts):
        if count == 0:
            raise CorpusError(f"{path} is empty; fill it or leave its split out of splits=")
    if counts[0] != counts[1]:
        raise CorpusError(
            f"{names[0]} has {counts[0]} lines but {names[1]} has {counts[1]}; the files of a "
            "split must be line-aligned (line i of one translates line i of the other). Fix the "
            f"files in {os.path.dirname(source_path)}"
        )
    if kept == 0:
        raise CorpusError(
            f"Every line pair of {names[0]} / {names[1]} has an empty side; fill the files or "
            "leave their split out of splits="
        )
    return skipped


class LocalPairsBuilder(PairsBuilder, skip_registration=True):
    """The local corpus builders (here and `tsv_pairs.py`): their ``DatasetInfo`` saves the
    skipped-pair counts."""

    STORES_METADATA: ClassVar[bool] = True

    def _description(self) -> str:
        return f"Sentence pairs from local files ({self.__class__.__name__})."


class ParallelText(LocalPairsBuilder, skip_registration=True):
    """TFDS builder of a line-aligned corpus; construct it with a :class:`ParallelTextConfig`.

    Features ``{"source": Text, "target": Text}`` in file order, keyed by 1-based line number.
    Line pairs with an empty side are skipped; ``info.metadata["skipped_empty_pairs"]`` maps
    each split to how many.
    """

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
        del dl_manager  # Everything is local.
        # Check every split first: TFDS writes as it consumes the generators, and a corpus error
        # found half-way would waste the work done until then.
        files = self.builder_config.files
        self.info.metadata[SKIPPED_KEY] = {s: _check_aligned(*p) for s, p in files.items()}
        return {split: self._generate_examples(*paths) for split, paths in files.items()}

    def _generate_examples(self, source_path: str, target_path: str) -> Iterator[tuple[int, dict]]:
        pairs = zip(read_lines(source_path), read_lines(target_path))
        for number, (source, target) in enumerate(pairs, start=1):
            if source and target:
                yield number, {"source": source, "target": target}


def load_parallel_text(
    corpus_dir: str | os.PathLike,
    source_lang: str,
    target_lang: str,
    *,
    tfds_dir: str | os.PathLike,
    splits: Sequence[str] | None = None,
    log: Log = print,
) -> dict[str, Sequence[dict[str, bytes]]]:
    """Prepares (once per corpus state) and opens a line-aligned corpus stored under ``tfds_dir``.

    Args:
        corpus_dir: directory of ``{split}.{lang}`` / ``{split}.{lang}.gz`` UTF-8 files.
        source_lang: extension of the source files, e.g. ``"en"``.
        target_lang: extension of the target files, e.g. ``"de"``.
        tfds_dir: where the ``array_record`` files are written and looked up.
        splits: splits to load; by default every split with files in both languages.
        log: called with progress lines, including how many pairs were skipped per split.

    Returns:
        ``{split: source}``; each source is a random-access sequence of
        ``{"source": bytes, "target": bytes}`` in file order.
    """
    config = ParallelTextConfig(
        data_dir=corpus_dir, source_lang=source_lang, target_lang=target_lang, splits=splits
    )
    builder = ParallelText(data_dir=os.fspath(tfds_dir), config=config, file_format="array_record")
    return prepare(builder, config.splits, log)
