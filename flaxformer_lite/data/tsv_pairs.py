"""A tab-separated file of sentence pairs (e.g. Anki's ``fra.txt``) as seeded splits.

:func:`load_tsv_pairs` prepares it once per file state and arguments into ``array_record``
files, as `translation.py`'s line-aligned loader does, and returns ``{split: source}`` for
"train", "validation" and "test"; the lines are assigned to splits by
:func:`split_line_indices`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from flaxformer_lite.data._tfds import SKIPPED_KEY, Log, prepare
from flaxformer_lite.data.examples import SPLITS, check_fractions, seeded_split
from flaxformer_lite.data.translation import (
    CorpusError,
    LocalPairsBuilder,
    files_fingerprint,
    read_lines,
    safe_name,
)

TSV_SPLITS: tuple[str, ...] = SPLITS


def split_line_indices(
    num_lines: int, *, seed: int, valid_fraction: float, test_fraction: float
) -> dict[str, np.ndarray]:
    """Assigns the lines ``0 .. num_lines - 1`` of a pairs file to splits, reproducibly.

    The lines are assigned by :func:`~.examples.seeded_split`. The split is by line, not by
    content: a pair repeated on several lines may land in several splits.

    Returns:
        ``{"train": ..., "validation": ..., "test": ...}`` of sorted ``int64[n_split]`` arrays of
        0-based line indices; they are disjoint and together hold every index once.
    """
    indices = seeded_split(
        num_lines, seed=seed, valid_fraction=valid_fraction, test_fraction=test_fraction
    )
    return {split: np.sort(ids) for split, ids in indices.items()}


class PairsTSVConfig(tfds.core.BuilderConfig):
    """Config of :class:`PairsTSV`: the file, which fields are source and target, and the split
    (:func:`split_line_indices` over all lines). The ``name`` encodes every argument and a
    fingerprint of the file."""

    def __init__(
        self,
        *,
        path: str | os.PathLike,
        source_column: int = 0,
        target_column: int = 1,
        seed: int = 0,
        valid_fraction: float = 0.05,
        test_fraction: float = 0.05,
    ) -> None:
        path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(path):
            raise CorpusError(f"Pairs file {path} does not exist; pass the path of a .tsv file")
        if min(source_column, target_column) < 0:
            raise ValueError(f"Columns must be >= 0, got {source_column} and {target_column}")
        check_fractions(valid_fraction, test_fraction)
        super().__init__(
            name=f"{safe_name(os.path.basename(path))}_c{source_column}-{target_column}_s{seed}"
            f"_v{valid_fraction:g}_t{test_fraction:g}_{files_fingerprint([path])}",
            version=tfds.core.Version("1.0.0"),
            description=f"Fields {source_column} -> {target_column} of {path}, split with seed "
            f"{seed}, validation fraction {valid_fraction}, test fraction {test_fraction}.",
        )
        self.path = path
        self.columns = (source_column, target_column)
        self.seed = seed
        self.valid_fraction = valid_fraction
        self.test_fraction = test_fraction

    def pair(self, line: str, number: int) -> tuple[str, str]:
        """Returns the ``(source, target)`` fields of line ``number`` (1-based); ``("", "")``
        for a blank line."""
        if not line:
            return "", ""
        fields = line.split("\t")
        if len(fields) <= max(self.columns):
            raise CorpusError(
                f"{os.path.basename(self.path)} line {number} has {len(fields)} tab-separated "
                f"field(s) but {max(self.columns) + 1} are needed for source_column, "
                f"target_column = {self.columns}; fix the line or the columns "
                f"(line: {line[:80]!r})"
            )
        return fields[self.columns[0]], fields[self.columns[1]]


class PairsTSV(LocalPairsBuilder, skip_registration=True):
    """TFDS builder of a tab-separated pairs file; construct it with a :class:`PairsTSVConfig`.

    Features ``{"source": Text, "target": Text}``; splits "train", "validation", "test", each
    in file order and keyed by 1-based line number. Extra fields (e.g. an attribution column)
    are ignored; blank lines and pairs with an empty side are skipped and counted in
    ``info.metadata["skipped_empty_pairs"]``.
    """

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
        del dl_manager
        config = self.builder_config
        # One checking pass before anything is written, as in `ParallelText`.
        empty = []
        num_lines = 0
        for num_lines, line in enumerate(read_lines(config.path), start=1):
            if not all(config.pair(line, num_lines)):
                empty.append(num_lines - 1)
        if num_lines == 0:
            raise CorpusError(f"{config.path} is empty; pass a file with one pair per line")
        indices = split_line_indices(
            num_lines,
            seed=config.seed,
            valid_fraction=config.valid_fraction,
            test_fraction=config.test_fraction,
        )
        skipped = {split: int(np.isin(empty, ids).sum()) for split, ids in indices.items()}
        self.info.metadata[SKIPPED_KEY] = skipped
        # TFDS cannot write a split without examples, so those are filled in by the loader.
        return {
            split: self._generate_examples(ids)
            for split, ids in indices.items()
            if len(ids) > skipped[split]
        }

    def _generate_examples(self, indices: np.ndarray) -> Iterator[tuple[int, dict]]:
        wanted = set(indices.tolist())
        for index, line in enumerate(read_lines(self.builder_config.path)):
            if index in wanted:
                source, target = self.builder_config.pair(line, index + 1)
                if source and target:
                    yield index + 1, {"source": source, "target": target}


def load_tsv_pairs(
    path: str | os.PathLike,
    *,
    tfds_dir: str | os.PathLike,
    source_column: int = 0,
    target_column: int = 1,
    seed: int = 0,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    log: Log = print,
) -> dict[str, Sequence[dict[str, bytes]]]:
    """Prepares (once per file state and arguments) and opens a tab-separated pairs file.

    Splits are made by :func:`split_line_indices`; :class:`PairsTSV` says what is skipped. For
    ``fra.txt`` (``English<TAB>French``) the default columns give en->fr, and
    ``source_column=1, target_column=0`` gives fr->en.

    Returns:
        ``{split: source}`` for "train", "validation" and "test"; each source is a random-access
        sequence of ``{"source": bytes, "target": bytes}`` in file order. A split without
        examples (e.g. fraction 0) is an empty tuple.
    """
    config = PairsTSVConfig(
        path=path,
        source_column=source_column,
        target_column=target_column,
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
    )
    builder = PairsTSV(data_dir=os.fspath(tfds_dir), config=config, file_format="array_record")
    return prepare(builder, TSV_SPLITS, log)
