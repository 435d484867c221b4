"""The CTC loss and the best CTC alignment (Graves et al. 2006) of a non-autoregressive decoder.

A CTC decoder emits one symbol per position, a token or the blank; its output is
read by merging repeated symbols and dropping the blanks (`search/ctc_collapse.py`),
so many paths (alignments) give the same tokens. The loss is -log of the summed
probability of every path of the row's T positions that collapses to its target:
`optax.ctc_loss`'s forward algorithm over the lattice of the target's L tokens
with blanks around each (b y1 b y2 ... yL b, K = 2L + 1 states). Between two equal
adjacent tokens the path must pass through a blank, so a target needs L + r
positions, r its adjacent repeats; a row with fewer has no path
(`alignable`), and the model leaves it out of the loss.

`best_alignment` is the Viterbi path over the same lattice: the single most
probable path that collapses to the target, as the symbol of each position.
Glancing (`objectives/glancing.py`) reads it as the target of every decoder
position.

Rows are right-padded on both sides: frames (decoder positions) by
`frame_valid`, target tokens by `label_valid`, each a prefix of its row.
Letters: B rows, T frames, N target tokens, V vocabulary, K = 2N + 1 states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# log 0 of the Viterbi lattice: finite, so that sums of it stay ordered (no inf - inf).
NEG = -1.0e30


def required_frames(labels: jax.Array, label_valid: jax.Array) -> jax.Array:
    """The fewest frames that can emit each target: its tokens plus one blank per repeat.

    Args:
      labels: int[B, N]; label_valid: bool[B, N], a prefix of each row.
    Returns:
      int32[B].
    """
    repeat = (labels[:, 1:] == labels[:, :-1]) & label_valid[:, 1:]
    return (label_valid.sum(-1) + repeat.sum(-1)).astype(jnp.int32)


def alignable(labels: jax.Array, label_valid: jax.Array, frame_valid: jax.Array) -> jax.Array:
    """bool[B]: the rows whose target has at least one path over their frames."""
    return required_frames(labels, label_valid) <= frame_valid.sum(-1)


def ctc_nll(
    logits: jax.Array,
    frame_valid: jax.Array,
    labels: jax.Array,
    label_valid: jax.Array,
    blank_id: int,
) -> jax.Array:
    """-log P(target) summed over every alignment, per row (`optax.ctc_loss`).

    Args:
      logits: float[B, T, V]; columns that must never be emitted should hold a
        large finite negative logit (not -inf: optax multiplies them by 0).
      frame_valid: bool[B, T]; labels: int[B, N]; label_valid: bool[B, N].
    Returns:
      float32[B]; an unalignable row gets about -log_epsilon = 1e5 (mask it out).
    """
    # optax reads a repeat wherever two adjacent labels are equal, padding included: padding
    # with the blank, which no target holds, keeps the last token from "repeating".
    labels = jnp.where(label_valid, labels, blank_id)
    return optax.ctc_loss(
        logits.astype(jnp.float32),
        1.0 - frame_valid.astype(jnp.float32),
        labels,
        1.0 - label_valid.astype(jnp.float32),
        blank_id=blank_id,
    )


def _lattice(labels: jax.Array, label_valid: jax.Array, blank_id: int):
    """(states int32[B, K]: b y1 b y2 ... yN b; skip bool[B, K]: state k may be entered
    from k - 2, i.e. it is a token that differs from the token before the blank)."""
    b, n = labels.shape
    labels = jnp.where(label_valid, labels, blank_id).astype(jnp.int32)
    states = jnp.full((b, 2 * n + 1), blank_id, jnp.int32).at[:, 1::2].set(labels)
    two_back = jnp.pad(states[:, :-2], ((0, 0), (2, 0)), constant_values=blank_id)
    return states, (states != blank_id) & (states != two_back)


def _shift(x: jax.Array, k: int) -> jax.Array:
    """x[:, s - k] at state s (NEG before the first state): [B, K]."""
    return jnp.pad(x[:, :-k], ((0, 0), (k, 0)), constant_values=NEG) if k else x


def _viterbi_forward(emit: jax.Array, frame_valid: jax.Array, skip: jax.Array):
    """Best-path scores at the last frame [B, K] and the back-pointers int32[T - 1, B, K]
    (0 stay, 1 from k - 1, 2 from k - 2) of frames 1..T-1; a padded frame keeps the scores.

    Args:
      emit: float32[T, B, K], the log-probability of each state's symbol at each frame.
    """
    first = jnp.full(emit.shape[1:], NEG, jnp.float32)
    first = first.at[:, :2].set(emit[0, :, :2])  # a path starts with a blank or the first token

    def frame(alpha, inputs):
        e, valid = inputs  # [B, K], bool[B]
        came = jnp.stack([alpha, _shift(alpha, 1), jnp.where(skip, _shift(alpha, 2), NEG)], -1)
        back = jnp.argmax(came, axis=-1).astype(jnp.int32)  # ties: stay, then k - 1
        alpha_next = jnp.max(came, axis=-1) + e
        return (
            jnp.where(valid[:, None], alpha_next, alpha),
            jnp.where(valid[:, None], back, 0),
        )

    return jax.lax.scan(frame, first, (emit[1:], frame_valid[:, 1:].T))


def best_alignment(
    log_probs: jax.Array,
    frame_valid: jax.Array,
    labels: jax.Array,
    label_valid: jax.Array,
    blank_id: int,
) -> tuple[jax.Array, jax.Array]:
    """The most probable path that collapses to the target (Viterbi over the CTC lattice).

    Args:
      log_probs: float[B, T, V] log-probabilities; frame_valid: bool[B, T];
      labels: int[B, N]; label_valid: bool[B, N].
    Returns:
      (path int32[B, T]: the symbol (token or blank_id) each frame emits on it,
      blank_id at padded frames; its log-probability float32[B]). A row that is not
      `alignable` gets a score near NEG and a path that means nothing.
    """
    states, skip = _lattice(labels, label_valid, blank_id)
    b, t, _ = log_probs.shape
    index = jnp.broadcast_to(states[:, None, :], (b, t, states.shape[1]))
    emit = jnp.take_along_axis(log_probs.astype(jnp.float32), index, axis=-1)  # [B, T, K]
    alpha, backs = _viterbi_forward(emit.transpose(1, 0, 2), frame_valid, skip)
    # A path ends on the last token (state 2L - 1) or on the blank after it (state 2L).
    last = 2 * label_valid.sum(-1).astype(jnp.int32)  # [B]
    rows = jnp.arange(b)
    on_blank = alpha[rows, last]
    on_token = jnp.where(last > 0, alpha[rows, jnp.maximum(last - 1, 0)], NEG)
    end = jnp.where(on_token > on_blank, last - 1, last)

    def frame(state, back):  # back-pointers of frame t + 1; state: the path's state there
        return state - back[rows, state], states[rows, state]

    start, later = jax.lax.scan(frame, end, backs, reverse=True)  # later: int[T - 1, B]
    path = jnp.concatenate([states[rows, start][None], later], axis=0).T  # [B, T]
    return jnp.where(frame_valid, path, blank_id), jnp.maximum(on_blank, on_token)
