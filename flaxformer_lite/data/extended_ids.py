"""Extended ids: the source pieces a copy head can emit although the vocabulary cannot spell them.

A pointer-generator (`models/copy_transformer.py`) emits a source token by pointing at it. A
token of the (shared) vocabulary is emitted by its id. A source piece that is ``<unk>`` (made
of characters the vocabulary never saw; SentencePiece keeps their raw text as the piece) gets
a per-example extended id ``V + k``: ``V`` is the vocabulary size and ``k`` numbers the
distinct unknown pieces of that source in order of appearance. The model can emit ``V + k``
like any other token, and the output text takes its surface from the source line.

In batches of a run with the copy head:

* ``"inputs"`` hold ``V + k`` at those source positions (the encoder embeds them as
  ``UNK_ID``; the copy head reads the extended id);
* ``"targets"`` hold ``V + k`` where a target piece is ``<unk>`` with the same text as the
  source's piece ``k``, so the loss teaches the model to copy it; any other ``<unk>`` stays
  ``UNK_ID``.

``oov[k]`` (a tuple per example, ``Tokenized.oov``) is the text of extended id ``V + k``.
Rows without extended ids decode exactly as :meth:`Tokenizer.decode` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from flaxformer_lite.data.tokenizer import Tokenizer, with_eos

UNK_SURFACE = " \u2047 "  # how SentencePiece renders an UNK_ID it decodes
WORD_BOUNDARY = "\u2581"  # SentencePiece's space


class ExtendedVocabulary:
    """A shared tokenizer whose unknown source pieces get per-example extended ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def size(self) -> int:
        """``V``: the first extended id."""
        return self.tokenizer.vocab_size

    def encode_source(self, text: str, max_len: int) -> tuple[list[int], tuple[str, ...], bool]:
        """Source ids + EOS with extended ids, cut to ``max_len`` as :func:`with_eos` cuts.

        Only pieces that survive the cut get extended ids, so a target never points at a
        source position that is not there.

        Returns:
            ``(ids, oov, truncated)``: ``oov[k]`` is the text of id ``V + k``.
        """
        ids, pieces = self.tokenizer.encode_with_pieces(text)
        ids, truncated = with_eos(ids, max_len)
        oov: list[str] = []
        for i, token in enumerate(ids[:-1]):
            if token == UNK_ID:
                piece = pieces[i]
                if piece not in oov:
                    oov.append(piece)
                ids[i] = self.size + oov.index(piece)
        return ids, tuple(oov), truncated

    def encode_target(self, text: str, oov: Sequence[str], max_len: int) -> tuple[list[int], bool]:
        """Target ids + EOS: an ``<unk>`` piece whose text is ``oov[k]`` becomes ``V + k``.

        Returns:
            ``(ids, truncated)`` as :func:`with_eos`.
        """
        ids, pieces = self.tokenizer.encode_with_pieces(text)
        if oov:
            ids = [
                self.size + oov.index(piece) if token == UNK_ID and piece in oov else token
                for token, piece in zip(ids, pieces)
            ]
        return with_eos(ids, max_len)

    def decode(self, ids, oov: Sequence[str] = ()) -> str:
        """Text of ids up to the first EOS; ``V + k`` is ``oov[k]`` (an id without an entry
        renders as an unknown piece). Without extended ids, exactly ``Tokenizer.decode``."""
        row = np.asarray(ids).reshape(-1).tolist()
        if not any(t >= self.size for t in row):
            return self.tokenizer.decode(row)
        parts: list[str] = []
        for token in row:
            if token == EOS_ID:
                break
            if token in (PAD_ID, BOS_ID):
                continue
            parts.append(UNK_SURFACE if token == UNK_ID else self.piece(token, oov))
        # SentencePiece drops the word boundaries in front of the first word.
        return "".join(parts).lstrip(WORD_BOUNDARY).replace(WORD_BOUNDARY, " ")

    def decode_batch(self, ids, oovs: Sequence[Sequence[str]]) -> list[str]:
        """:meth:`decode` of every row of ``ids`` ``[n, length]`` with its ``oovs[i]``."""
        return [self.decode(row, oov) for row, oov in zip(np.asarray(ids), oovs)]

    def piece(self, token: int, oov: Sequence[str] = ()) -> str:
        """The piece of one id for display (plots): ``oov[k]`` for ``V + k``."""
        if token >= self.size:
            k = token - self.size
            return oov[k] if k < len(oov) else UNK_SURFACE
        return self.tokenizer.id_to_piece(token)
