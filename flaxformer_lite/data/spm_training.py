"""Training a SentencePiece model in memory, deterministically, with the reserved ids.

The same texts and arguments give a byte-identical serialized model, so a vocabulary can
be rebuilt instead of shipped. `tokenizer.Tokenizer.train` wraps the model in a tokenizer.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

import sentencepiece as spm

from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID

MODEL_TYPES = ("unigram", "bpe", "char", "word")


def train_model(
    texts: Iterable[str],
    vocab_size: int,
    model_type: str = "unigram",
    *,
    split_digits: bool = True,
    character_coverage: float = 1.0,
    user_defined_symbols: Sequence[str] = (),
    normalization_rule_name: str = "identity",
) -> bytes:
    """Trains a SentencePiece model in memory on ``texts``; returns its serialized ``ModelProto``.

    Args:
        texts: training sentences, one string each (iterated once).
        vocab_size: target vocabulary size including the 4 reserved pieces. It is a soft
            limit: when the data cannot support that many pieces SentencePiece returns a
            smaller vocabulary instead of failing.
        model_type: "unigram", "bpe", "char" or "word".
        split_digits: split numbers into single digits, so every number is spelled with
            the same 10 pieces.
        character_coverage: fraction of characters covered by the vocabulary; the rest map
            to ``UNK_ID``.
        user_defined_symbols: pieces that are always kept whole.
        normalization_rule_name: SentencePiece normalization. The default "identity" keeps
            every character as is, so ``decode(encode(text)) == text`` for texts made of
            known characters and single spaces, which exact-match metrics rely on.

    Returns:
        The serialized model, whose reserved ids are those of ``constants.py``.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        split_digits=split_digits,
        character_coverage=character_coverage,
        user_defined_symbols=list(user_defined_symbols),
        normalization_rule_name=normalization_rule_name,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        hard_vocab_limit=False,
        # Determinism: one thread, every sentence used in input order (no random sampling
        # or shuffling of the input).
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        # Sentences longer than the default 4192 bytes would otherwise be skipped silently.
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    return model.getvalue()
