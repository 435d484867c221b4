"""Scheduled sampling: training on the model's own predictions instead of the gold prefix.

Teacher forcing feeds the decoder the gold prefix; decoding feeds it its own
outputs. Scheduled sampling (Bengio et al. 2015) closes part of that gap: at
training step i every decoder input is, with probability eps_i, the gold
token, and otherwise one made from the model's prediction. A Transformer
decodes a whole sequence in one pass, so the predictions come from an extra
pass (Mihaylova & Martins 2019):

  pass 1: teacher-forced, decoder inputs = BOS + y[:-1]   -> logits_1 [B, T, V]
  mixing: input t (t >= 1, not padding) becomes, with probability 1 - eps_i,
          a token or embedding made from logits_1[t - 1]: the prediction of
          y[t - 1], which is exactly what input t holds under teacher forcing
  pass 2: the same decoder on the mixed inputs           -> logits_2, the loss

With `passes` = K > 2 the mixing is repeated from each pass's logits
(Duckworth et al. 2019, parallel scheduled sampling), the loss on the last
pass. What is fed (`mode`):

  argmax  the most likely token of logits_1[t - 1]
  sample  a token drawn from softmax(logits_1[t - 1] / temperature)
  soft    the embedding average under softmax(logits_1[t - 1] / temperature),
          which -> the argmax embedding as temperature -> 0

eps_i follows one of the paper's schedules over training steps (i counts
from the end of `warmup_steps` of pure teacher forcing), never below eps_min:

  linear           max(eps_min, k - c * i)
  exponential      k ** i            (k < 1)
  inverse_sigmoid  k / (k + exp(i / k))   (k >= 1)
  constant         k

Nothing here knows the model: `mix_inputs` turns logits and gold decoder
inputs into replacements that the model's decoder embeds
(`models/autoregressive.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.config.variants import SAMPLING_SCHEDULES, ScheduledSampling
from flaxformer_lite.constants import PAD_ID


def gold_probability(cfg: ScheduledSampling, step: jax.Array) -> jax.Array:
    """eps_i: the probability of feeding the gold token at global step `step` (float32 scalar).

    1 during the warm-up; then the schedule at i = step - warmup_steps, floored at eps_min.
    """
    i = jnp.maximum(jnp.asarray(step, jnp.float32) - cfg.warmup_steps, 0.0)
    k = jnp.float32(cfg.k)
    if cfg.schedule == "linear":
        eps = k - cfg.c * i
    elif cfg.schedule == "exponential":
        eps = k**i
    elif cfg.schedule == "inverse_sigmoid":
        eps = k / (k + jnp.exp(i / k))  # exp overflows to inf, eps to 0: no NaN
    elif cfg.schedule == "constant":
        eps = k
    else:
        choices = ", ".join(SAMPLING_SCHEDULES)
        raise ValueError(f"unknown schedule {cfg.schedule!r}; one of {choices}")
    eps = jnp.clip(jnp.maximum(eps, cfg.eps_min), 0.0, 1.0)
    return jnp.where(jnp.asarray(step) < cfg.warmup_steps, 1.0, eps)


def shift_predictions(x: jax.Array) -> jax.Array:
    """Moves pass-1 predictions one position right: out[:, t] = x[:, t - 1], out[:, 0] = x[:, 0].

    Position t's decoder input under teacher forcing is y[t - 1], and the
    prediction of y[t - 1] is made at position t - 1. Position 0 (BOS) is never
    replaced, so what it holds does not matter.

    Args:
      x: [B, T, ...] predicted tokens or token distributions.
    """
    return jnp.concatenate([x[:, :1], x[:, :-1]], axis=1)


def replaceable(decoder_inputs: jax.Array, bos_id: int) -> jax.Array:
    """bool[B, T]: the inputs that may be replaced: neither BOS (each example's first, also
    in packed rows) nor padding."""
    return (decoder_inputs != bos_id) & (decoder_inputs != PAD_ID)


def mix_inputs(
    cfg: ScheduledSampling,
    logits: jax.Array,
    decoder_inputs: jax.Array,
    eps: jax.Array,
    rng: jax.Array,
    bos_id: int,
) -> tuple[jax.Array, jax.Array]:
    """Which decoder inputs to replace, and by what.

    Args:
      logits: float32[B, T, V] of the previous pass (position t predicts y[t]).
      decoder_inputs: int[B, T] gold decoder inputs BOS + y[:-1] (segments start with BOS).
      eps: probability of keeping the gold input.
      rng: key of the coin flips (and of the samples).
    Returns:
      (use bool[B, T], replacement): `use` marks the replaced positions, each with
      probability 1 - eps among `replaceable` ones; replacement is int[B, T] tokens
      (argmax, sample) or float32[B, T, V] embedding weights (soft), already shifted
      so that position t holds what was predicted at t - 1.
    """
    coin_key, sample_key = jax.random.split(rng)
    use = jax.random.bernoulli(coin_key, 1.0 - eps, decoder_inputs.shape)
    use &= replaceable(decoder_inputs, bos_id)
    if cfg.mode == "argmax":
        new = jnp.argmax(logits, axis=-1).astype(decoder_inputs.dtype)
    elif cfg.mode == "sample":
        new = jax.random.categorical(sample_key, logits / cfg.temperature, axis=-1)
        new = new.astype(decoder_inputs.dtype)
    elif cfg.mode == "soft":
        new = jax.nn.softmax(logits / cfg.temperature, axis=-1)
    else:
        raise ValueError(f"mix_inputs needs a mixing mode, not {cfg.mode!r}")
    return use, shift_predictions(new)
