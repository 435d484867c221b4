"""SentencePiece subword tokenizer with fixed reserved ids.

The model code relies on these ids and never looks them up:

* ``PAD_ID = 0``: right padding of every id array; masked out of attention and of the loss.
* ``UNK_ID = 1``: any character not covered by the vocabulary (encoding never raises).
* ``BOS_ID = 2``: reserved start token (e.g. a decoder start); never produced by
  :meth:`Tokenizer.encode`.
* ``EOS_ID = 3``: end of sequence; :func:`with_eos` appends it (keeping it last when cutting
  to a maximum length) and :meth:`Tokenizer.decode` stops at it.

Training is in memory and deterministic (``spm_training.py``): the same texts and arguments
give a byte-identical serialized model, so a vocabulary can be rebuilt instead of shipped.

:class:`Vocabularies` pairs a source and a target tokenizer: one shared model (the
default; ``vocab.spm`` in a workdir) or two separate ones (``vocab.source.spm`` and
``vocab.target.spm``). Both use the reserved ids above.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm

from flaxformer_lite.atomic_files import atomic_write
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from flaxformer_lite.data import spm_training


class VocabularyFileError(FileNotFoundError):
    """A vocabulary file that exists but holds no usable SentencePiece model.

    A FileNotFoundError, so that every caller that handles a missing vocabulary (the
    command lines' one-line errors, decoding's "restore it or rebuild it" advice) handles
    an unreadable one the same way: both are fixed by restoring or rebuilding the file.
    """


def with_eos(ids: Sequence[int], max_len: int) -> tuple[list[int], bool]:
    """``ids`` + EOS_ID, cut to ``max_len`` ids so that EOS_ID stays last.

    The one rule for every over-long sequence the model reads: the model always sees an end
    marker, and the cut is reported so callers can count (or refuse) truncated examples.

    Args:
        ids: token ids without EOS, e.g. ``Tokenizer.encode(text)``.
        max_len: the most ids of the result, EOS included; must be >= 1.

    Returns:
        ``(ids, truncated)``: a new list of ``min(len(ids) + 1, max_len)`` ids ending in
        EOS_ID, and whether ids were dropped.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    truncated = len(ids) >= max_len  # no room for EOS after all ids
    return [*ids[: max_len - 1], EOS_ID] if truncated else [*ids, EOS_ID], truncated


class Tokenizer:
    """A SentencePiece model plus the batch helpers the data pipeline needs.

    Construct with :meth:`train`, :meth:`from_bytes` or :meth:`load`. Instances are picklable
    (through the serialized model), so they can be sent to data-loading worker processes.
    """

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        """Wraps a loaded processor; prefer the ``train``/``from_bytes``/``load`` constructors.

        Raises:
            ValueError: if the model does not use the reserved ids of this module.
        """
        expected = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
        actual = {
            "pad": processor.pad_id(),
            "unk": processor.unk_id(),
            "bos": processor.bos_id(),
            "eos": processor.eos_id(),
        }
        if actual != expected:
            raise ValueError(f"SentencePiece model has special ids {actual}, expected {expected}")
        self._processor = processor

    # ----------------------------------------------------------------------------------------
    # Construction and serialization.

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        model_type: str = "unigram",
        *,
        split_digits: bool = True,
        character_coverage: float = 1.0,
        user_defined_symbols: Sequence[str] = (),
        normalization_rule_name: str = "identity",
    ) -> Tokenizer:
        """Trains a tokenizer in memory on ``texts``; the arguments are those of
        :func:`~.spm_training.train_model`."""
        return cls.from_bytes(
            spm_training.train_model(
                texts,
                vocab_size,
                model_type,
                split_digits=split_digits,
                character_coverage=character_coverage,
                user_defined_symbols=user_defined_symbols,
                normalization_rule_name=normalization_rule_name,
            )
        )

    @classmethod
    def from_bytes(cls, model: bytes) -> Tokenizer:
        """Builds a tokenizer from a serialized SentencePiece ``ModelProto``."""
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(model)
        return cls(processor)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads a tokenizer written by :meth:`save`.

        The file is parsed as a SentencePiece ``ModelProto`` (protobuf), never executed or
        unpickled.

        Raises:
            FileNotFoundError: no such file.
            VocabularyFileError: the file cannot be read, is not a SentencePiece model, or
                is one with other reserved ids than this module's.
        """
        try:
            with open(path, "rb") as f:
                model = f.read()
        except FileNotFoundError:
            raise
        except OSError as e:  # a directory, no permission
            raise VocabularyFileError(
                f"vocabulary file {os.fspath(path)} cannot be read: {e.strerror}"
            ) from None
        try:
            return cls.from_bytes(model)
        except RuntimeError:  # SentencePiece's parse failure, whose text names its C++ source
            reason = "not a SentencePiece model"
        except ValueError as e:  # a SentencePiece model, with other reserved ids
            reason = str(e)
        raise VocabularyFileError(
            f"vocabulary file {os.fspath(path)} is corrupted: {reason} (to rebuild it, "
            "delete it first)"
        )

    def to_bytes(self) -> bytes:
        """Returns the serialized SentencePiece ``ModelProto``."""
        return self._processor.serialized_model_proto()

    def save(self, path: str | os.PathLike) -> None:
        """Writes the serialized model to ``path`` atomically: a reader (or a crash) never sees
        a partially written model."""
        atomic_write(path, self.to_bytes())

    def __getstate__(self) -> dict[str, Any]:
        # The SWIG processor itself is not reliably picklable; its serialized model is.
        return {"model": self.to_bytes()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(state["model"])
        self._processor = processor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokenizer):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    # ----------------------------------------------------------------------------------------
    # Vocabulary.

    @property
    def vocab_size(self) -> int:
        """Number of pieces, reserved ones included; ids are in ``[0, vocab_size)``."""
        return self._processor.get_piece_size()

    def id_to_piece(self, token_id: int) -> str:
        """Returns the piece string of ``token_id``, e.g. ``"<pad>"`` for ``PAD_ID``."""
        return self._processor.id_to_piece(int(token_id))

    def piece_to_id(self, piece: str) -> int:
        """Returns the id of ``piece``, or ``UNK_ID`` if it is not in the vocabulary."""
        return self._processor.piece_to_id(piece)

    # ----------------------------------------------------------------------------------------
    # Encoding and decoding.

    def encode(self, text: str) -> list[int]:
        """Encodes one string to ids, without BOS or EOS; unknown characters become UNK_ID."""
        return self._processor.encode(text, out_type=int)

    def encode_many(self, texts: Sequence[str], chunk: int = 50_000) -> list[list[int]]:
        """``[encode(t) for t in texts]``, on every core of the host: SentencePiece encodes a
        list in C++ threads. Starting those threads costs more than a few short strings
        take (`encode_batch` keeps to one at a time); for a whole split the list is 1.4x
        faster on one thread and 2-3.7x on two cores (1.1M Tatoeba strings), and it
        scales with the host's cores."""
        threads = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        out: list[list[int]] = []
        for start in range(0, len(texts), chunk):
            part = list(texts[start : start + chunk])
            out.extend(self._processor.encode(part, out_type=int, num_threads=threads))
        return out

    def encode_with_pieces(self, text: str) -> tuple[list[int], list[str]]:
        """Ids of ``text`` (as :meth:`encode`) and each id's piece text; an ``UNK_ID`` piece
        is the raw characters it stands for (SentencePiece merges a run of unknown ones)."""
        ids = self._processor.encode(text, out_type=int)
        if UNK_ID not in ids:
            return ids, [self._processor.id_to_piece(i) for i in ids]
        pieces = self._processor.encode(text, return_type="proto").pieces
        return [p.id for p in pieces], [p.piece for p in pieces]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Decodes ids up to (excluding) the first EOS_ID, skipping PAD_ID and BOS_ID.

        Args:
            ids: a sequence or 1-D integer array, e.g. one row of model output
                ``int32[length]``.
        """
        pieces: list[int] = []
        for token_id in np.asarray(ids).reshape(-1).tolist():
            if token_id == EOS_ID:
                break
            if token_id in (PAD_ID, BOS_ID):
                continue
            pieces.append(int(token_id))
        return self._processor.decode(pieces)

    def encode_batch(
        self, texts: Sequence[str], max_len: int, add_eos: bool = True
    ) -> tuple[np.ndarray, int]:
        """Encodes strings into a fixed-shape, right-padded id array.

        Row ``i`` holds ``encode(texts[i])`` followed by EOS_ID (when ``add_eos``), then PAD_ID
        up to ``max_len``. A row that does not fit is truncated to ``max_len`` ids; with
        ``add_eos`` its last id is still EOS_ID (:func:`with_eos`).

        Args:
            texts: ``n`` strings.
            max_len: number of columns; must be >= 1.
            add_eos: whether to append EOS_ID.

        Returns:
            ``(ids, num_truncated)``: ``ids`` is ``int32[n, max_len]`` and ``num_truncated`` the
            number of rows that had to be truncated.
        """
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        texts = list(texts)
        ids = np.full((len(texts), max_len), PAD_ID, dtype=np.int32)
        if not texts:
            return ids, 0
        num_truncated = 0
        # Encoding strings one at a time is faster here than passing the list: SentencePiece's
        # list path starts a thread pool per call, which dominates for short texts.
        for row, text in enumerate(texts):
            tokens = self._processor.encode(text, out_type=int)
            if add_eos:
                tokens, truncated = with_eos(tokens, max_len)
            else:
                tokens, truncated = tokens[:max_len], len(tokens) > max_len
            num_truncated += truncated
            ids[row, : len(tokens)] = tokens
        return ids, num_truncated

    def decode_batch(self, ids: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
        """Decodes every row of an integer array ``[n, length]`` with :meth:`decode`."""
        array = np.asarray(ids)
        if array.ndim != 2:
            raise ValueError(f"decode_batch expects a 2-D array [n, length], got {array.shape}")
        return [self.decode(row) for row in array]


SHARED_VOCAB_FILE = "vocab.spm"
SOURCE_VOCAB_FILE = "vocab.source.spm"
TARGET_VOCAB_FILE = "vocab.target.spm"


@dataclasses.dataclass(frozen=True)
class Vocabularies:
    """The tokenizer of each side: the same object when the vocabulary is shared.

    Source text is encoded with ``source``; targets are encoded and model output
    decoded with ``target``. Functions that take "a tokenizer" accept either a
    :class:`Tokenizer` (shared) or a :class:`Vocabularies` (see :meth:`of`).
    """

    source: Tokenizer
    target: Tokenizer

    @classmethod
    def of(cls, tokenizer: Tokenizer | Vocabularies) -> Vocabularies:
        """``tokenizer`` itself if it is a pair, else the pair sharing it."""
        if isinstance(tokenizer, Vocabularies):
            return tokenizer
        return cls(tokenizer, tokenizer)

    @property
    def shared(self) -> bool:
        return self.source is self.target or self.source == self.target

    @classmethod
    def train(
        cls,
        source_texts: Sequence[str],
        target_texts: Sequence[str],
        vocab_size: int,
        model_type: str = "unigram",
        *,
        shared: bool = True,
        target_vocab_size: int | None = None,
    ) -> Vocabularies:
        """One model on both sides' texts (``shared``) or one per side.

        Args:
            vocab_size: size of the shared (or the source) vocabulary.
            target_vocab_size: size of the target vocabulary when not shared
                (None: ``vocab_size``).
        """
        if shared:
            if target_vocab_size not in (None, vocab_size):
                raise ValueError(
                    f"a shared vocabulary has one size, got {vocab_size} and {target_vocab_size}"
                )
            tok = Tokenizer.train(list(source_texts) + list(target_texts), vocab_size, model_type)
            return cls(tok, tok)
        return cls(
            Tokenizer.train(source_texts, vocab_size, model_type),
            Tokenizer.train(target_texts, target_vocab_size or vocab_size, model_type),
        )

    @staticmethod
    def files(directory: str | os.PathLike, shared: bool) -> list[str]:
        """The files :meth:`save` writes in ``directory``."""
        names = [SHARED_VOCAB_FILE] if shared else [SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE]
        return [os.path.join(directory, name) for name in names]

    def save(self, directory: str | os.PathLike) -> None:
        """Writes ``vocab.spm``, or ``vocab.source.spm`` and ``vocab.target.spm``."""
        for path, tok in zip(self.files(directory, self.shared), (self.source, self.target)):
            tok.save(path)

    @classmethod
    def exists(cls, directory: str | os.PathLike) -> bool:
        return any(
            all(os.path.exists(p) for p in cls.files(directory, shared)) for shared in (True, False)
        )

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Vocabularies:
        """Reads what :meth:`save` wrote in ``directory``.

        Raises:
            FileNotFoundError: naming the missing file(s); a directory with both
                a shared and separate vocabularies is refused as ambiguous.
            VocabularyFileError: a file that is there but unreadable or corrupted.
        """
        shared, separate = (cls.files(directory, s) for s in (True, False))
        have_shared = os.path.exists(shared[0])
        have_separate = [os.path.exists(p) for p in separate]
        if have_shared and any(have_separate):
            raise FileNotFoundError(
                f"{directory} holds both a shared vocabulary ({SHARED_VOCAB_FILE}) and separate "
                f"ones ({SOURCE_VOCAB_FILE}, {TARGET_VOCAB_FILE}); keep the one the model was "
                "trained with"
            )
        if have_shared:
            tok = Tokenizer.load(shared[0])
            return cls(tok, tok)
        if all(have_separate):
            return cls(Tokenizer.load(separate[0]), Tokenizer.load(separate[1]))
        missing = shared
        if any(have_separate):
            missing = [p for p, ok in zip(separate, have_separate) if not ok]
        raise FileNotFoundError(f"vocabulary file(s) missing: {', '.join(missing)}")
