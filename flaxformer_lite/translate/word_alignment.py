"""Word alignments of decoded hypotheses, read from one decoder layer's cross-attention.

A teacher-forced pass over (source, hypothesis) through the model protocol's
`attention_weights` gives the cross-attention of decoder layer `layer`,
float32[B, N, T, S]; its mean over the N heads is the alignment matrix. Each
target piece t (row t: the decoder step that emitted hypothesis token t) is
linked to the source piece of maximal attention, EOS and padding columns
excluded, and pieces are grouped into words: a SentencePiece piece starting
with "▁" starts a new word (a bare "▁" joins the word it precedes). A target
word takes the links of all its pieces, so it gets at least one; the result is
the sorted, deduplicated pairs (source word i, target word j), 0-based, as
Moses and fast_align write them ("0-0 1-2").

Attention is a diagnostic, not a trained aligner, and which layer aligns best
depends on the model (Garg et al. 2019 report the penultimate layer of their
6-layer model, averaged over heads): `decode.py --alignment_layer` picks it,
the last layer by default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.data.extended_ids import WORD_BOUNDARY, ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.translate.bucketing import Sources, batch_rows, bucket_lengths, plan_batches
from flaxformer_lite.translate.line_io import InputError

Pairs = tuple[tuple[int, int], ...]  # (source word, target word), sorted


def check_layer(layer: int, num_layers: int) -> None:
    """Raises InputError unless `layer` indexes one of `num_layers` decoder layers."""
    if not -num_layers <= layer < num_layers:
        raise InputError(f"--alignment_layer {layer} is out of range for {num_layers} layer(s)")


def piece_words(pieces: Sequence[str | None]) -> list[int | None]:
    """The word index of every piece, 0-based; None for a None entry (EOS, padding).

    A piece starting with "▁" starts a word, and so does the first piece. A bare "▁"
    belongs to the word of the piece after it when that piece continues it (SentencePiece
    writes "de" as "▁", "d", "e"); otherwise (before another "▁" piece, or last) it
    belongs to no word: None. So the words are those of the decoded text split on
    spaces (an "<unk>" piece inside a word stays in that word).
    """
    words: list[int | None] = []
    count, boundary = 0, True  # boundary: the next content piece starts a word
    for k, piece in enumerate(pieces):
        if piece is None or piece == WORD_BOUNDARY:
            after = pieces[k + 1] if k + 1 < len(pieces) else None
            joins = piece is not None and after is not None
            joins = joins and not after.startswith(WORD_BOUNDARY)
            words.append(count if joins else None)  # the word the next piece starts
            boundary = True
            continue
        count += boundary or piece.startswith(WORD_BOUNDARY)
        words.append(count - 1)
        boundary = False
    return words


def token_words(ids: Sequence[int], piece: Callable[[int], str]) -> list[int | None]:
    """`piece_words` of token ids: EOS, PAD and BOS are in no word."""
    return piece_words([None if t in (EOS_ID, PAD_ID, BOS_ID) else piece(t) for t in ids])


def best_source_pieces(weights: jax.Array, source_valid: jax.Array) -> jax.Array:
    """The source position of maximal head-mean attention for every target position.

    Args:
      weights: float32[B, N, T, S] cross-attention probabilities (or [B, T, S], one head).
      source_valid: bool[B, S], False at EOS, padding and pieces in no word.
    Returns:
      int32[B, T]; 0 in a row without a valid source position.
    """
    mean = weights.mean(axis=1) if weights.ndim == 4 else weights  # [B, T, S]
    masked = jnp.where(source_valid[:, None, :], mean, -jnp.inf)  # [B, T, S]
    return jnp.argmax(masked, axis=-1).astype(jnp.int32)


def word_pairs(
    best: Sequence[int], source_words: Sequence[int | None], target_words: Sequence[int | None]
) -> Pairs:
    """Sorted, deduplicated (source word, target word) pairs of one hypothesis.

    Args:
      best: per target position, its best source position (`best_source_pieces`).
      source_words / target_words: `piece_words` of each side; None positions
        (EOS, padding) give no pair.
    """
    pairs = set()
    for t, j in enumerate(target_words):
        if j is None or t >= len(best) or best[t] >= len(source_words):
            continue
        i = source_words[best[t]]
        if i is not None:
            pairs.add((i, j))
    return tuple(sorted(pairs))


def align_attention(
    weights: np.ndarray, source_words: Sequence[int | None], target_words: Sequence[int | None]
) -> Pairs:
    """Word pairs of one hypothesis from its attention float32[N, T, S] (or [T, S])."""
    weights = np.asarray(weights, np.float32)
    weights = weights if weights.ndim == 3 else weights[None]  # [N, T, S]
    valid = np.zeros(weights.shape[-1], bool)  # [S]
    valid[: len(source_words)] = [w is not None for w in source_words]
    best = best_source_pieces(weights[None], valid[None])[0]  # [T]
    return word_pairs(np.asarray(best).tolist(), source_words, target_words)


def format_pairs(pairs: Pairs) -> str:
    """Moses / fast_align style: "0-0 1-2 2-1" (source-target, space-separated)."""
    return " ".join(f"{i}-{j}" for i, j in pairs)


@functools.partial(jax.jit, static_argnames=("model", "name"))
def _best_in_batch(model, params, inputs, targets, source_valid, name: str):
    """int32[B, T] best source positions of one padded batch: inputs int32[B, S], targets
    int32[B, T] (hypotheses with EOS, PAD_ID after), source_valid bool[B, S]."""
    batch = {"inputs": inputs, "targets": targets}
    weights = model.attention_weights(params, batch, (name,))[name]  # [B, N, T, S]
    return best_source_pieces(weights, source_valid)


def align_hypotheses(
    model,
    params,
    target_vocab: Tokenizer,
    sources: Sources,
    hypothesis_ids: Sequence[Sequence[Sequence[int]]],
    *,
    layer: int = -1,
    max_source_len: int,
    target_len: int,
    source_vocab: Tokenizer | None = None,
    batch_size: int = 32,
) -> list[list[Pairs]]:
    """Word pairs of every hypothesis of every line, batched.

    Args:
      sources: the decoded lines' source ids (`Sources.ids`, [] for a blank line; a copy
        head's extended ids labelled by `Sources.oov`).
      hypothesis_ids: per line, per hypothesis, the generated ids (EOS included).
      layer: decoder layer whose cross-attention aligns (negative counts from the last).
      max_source_len / target_len: sources are padded to a length of
        `bucket_lengths(max_source_len)` and hypotheses to `target_len` ids (the
        search's max_len), so the jitted pass compiles once per bucket, as decoding does.
      source_vocab: the source side's tokenizer (None: `target_vocab`, shared).
    Returns:
      Per line, per hypothesis, the sorted (source word, target word) pairs; [] for a
      blank line.
    """
    words = _Words(source_vocab or target_vocab, target_vocab, sources.oov)
    items = [(i, k) for i, hyps in enumerate(hypothesis_ids) for k in range(len(hyps))]
    items = [(i, k) for i, k in items if len(sources.ids[i])]
    lengths = [len(sources.ids[i]) for i, _ in items]
    rows = batch_rows(lengths, batch_size)
    out: list[list[Pairs]] = [[()] * len(hyps) for hyps in hypothesis_ids]
    name = f"decoder/cross/{layer}"
    for batch, length in plan_batches(lengths, rows, bucket_lengths(max_source_len)):
        chosen = [items[b] for b in batch]
        src = [words.source(sources.ids[i], i) for i, _ in chosen]
        inputs = np.full((rows, length), PAD_ID, np.int32)  # [B, S]
        targets = np.full((rows, target_len), PAD_ID, np.int32)  # [B, T]
        valid = np.zeros((rows, length), bool)  # [B, S]
        for row, (i, k) in enumerate(chosen):
            ids, hyp = sources.ids[i], hypothesis_ids[i][k][:target_len]
            inputs[row, : len(ids)], targets[row, : len(hyp)] = ids, hyp
            valid[row, : len(ids)] = [w is not None for w in src[row]]
        best = np.asarray(_best_in_batch(model, params, inputs, targets, valid, name))
        for row, (i, k) in enumerate(chosen):
            tgt = words.target(hypothesis_ids[i][k], i)
            out[i][k] = word_pairs(best[row].tolist(), src[row], tgt)
    return out


class _Words:
    """`token_words` of source and target ids, a copy head's extended ids labelled by
    their line's unknown pieces."""

    def __init__(self, source_vocab: Tokenizer, target_vocab: Tokenizer, oov) -> None:
        self.oov = oov
        self.source_piece = ExtendedVocabulary(source_vocab).piece
        self.target_piece = ExtendedVocabulary(target_vocab).piece

    def source(self, ids: Sequence[int], line: int) -> list[int | None]:
        unknown = self.oov[line] if self.oov is not None else ()
        return token_words(ids, lambda t: self.source_piece(t, unknown))

    def target(self, ids: Sequence[int], line: int) -> list[int | None]:
        unknown = self.oov[line] if self.oov is not None else ()
        return token_words(ids, lambda t: self.target_piece(t, unknown))
