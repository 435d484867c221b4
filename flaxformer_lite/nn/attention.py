"""Scaled dot-product attention and multi-head attention (masks: `masks.py`).

Einsum letter legend used throughout the project:
  B batch, T query length, S key/value length, D d_model, N heads,
  H per-head dim (d_k = d_v), F feed-forward dim, V vocabulary.

The core (`scaled_dot_product_attention`) is written for ONE example and ONE
head, exactly as the formula softmax(QK^T / sqrt(d_k)) V of Vaswani et al.
§3.2.1, and batched over heads and examples with `jax.vmap`. Masks are boolean
(True = may attend) and are applied before the softmax with the most negative
float32, so masked weights are exactly 0.0 after it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn import kernels, local_attention
from flaxformer_lite.nn.dropout import Dropout
from flaxformer_lite.nn.layers import project
from flaxformer_lite.nn.masks import AttentionMask, LocalMask, dense
from flaxformer_lite.nn.precision import dot_f32
from flaxformer_lite.parallel.partitioning import constrain

# [B, T, N, H] queries, keys and values: rows as the batch, heads over `model`.
HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")

# ----------------------------------------------------------------------------
# The core, for one example and one head.
# ----------------------------------------------------------------------------


def scaled_dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """softmax(q k^T / sqrt(d_k)) v for one example and one head.

    Args:
      q: [q_len, d_k] queries.
      k: [kv_len, d_k] keys.
      v: [kv_len, d_v] values.
      mask: bool[q_len, kv_len] (True = attend) or None.
    Returns:
      (out [q_len, d_v] in v's dtype, weights float32[q_len, kv_len]).
    """
    scores = dot_f32("th,sh->ts", q, k)  # float32 [T, S]; bf16 x bf16 backward too
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    if mask is not None:
        # finfo.min rather than -inf: a fully masked row (a padded query) stays
        # finite instead of NaN, and exp(min - max) underflows to exactly 0.0.
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # float32 [T, S]
    out = jnp.einsum("ts,sh->th", weights.astype(v.dtype), v)
    return out, weights


def batched_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """The single-head core vmapped over heads, then over the batch.

    Args:
      q: [batch, q_len, heads, d_k].
      k: [batch, kv_len, heads, d_k].
      v: [batch, kv_len, heads, d_v].
      mask: bool[batch, q_len, kv_len] (shared by all heads) or None.
    Returns:
      (out [batch, q_len, heads, d_v], weights float32[batch, heads, q_len, kv_len]).
    """
    over_heads = jax.vmap(
        scaled_dot_product_attention,
        in_axes=(1, 1, 1, None),  # heads are axis 1 of [T|S, N, H]; the mask has none
        out_axes=(1, 0),  # out [T, N, H], weights [N, T, S]
    )
    over_batch = jax.vmap(over_heads, in_axes=(0, 0, 0, None if mask is None else 0))
    return over_batch(q, k, v, mask)


def fast_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Same result as `batched_attention` through `jax.nn.dot_product_attention`'s XLA
    implementation, which does not return the weights. Shapes as in `batched_attention`.
    (The fused kernels are in `kernels.py`.)
    """
    if mask is not None:
        mask = mask[:, None, :, :]  # [B, 1, T, S]: broadcast over heads
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def cached_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The core's formula over keys/values kept in the decoding layout.

    A decoding step reads the whole cache, so its layout decides the step's cost: keys
    are kept as [B, N, H, S] and values as [B, N, S, H], heads first, so both batched
    matmuls read the cache as it lies, where the teacher-forced [B, S, N, H] layout
    made XLA transpose every cache tensor at every step (docs/results.md, design decisions).

    Args:
      q: [batch, q_len, heads, d_k] the new queries.
      k: [batch, heads, d_k, kv_len]; v: [batch, heads, kv_len, d_v].
      mask: bool[batch, q_len, kv_len].
    Returns:
      (out [batch, q_len, heads, d_v], weights float32[batch, heads, q_len, kv_len]).
    """
    scores = jnp.einsum("btnh,bnhs->bnts", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # float32 [B, N, T, S]
    out = jnp.einsum("bnts,bnsh->btnh", weights.astype(v.dtype), v)
    return out, weights


def _beams_over_one_source(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`cached_attention` where K = q.shape[0] / k.shape[0] query rows (the beams of one
    sentence, rows b*K..b*K+K-1) share keys/values row b: cross-attention K/V are then kept
    once per sentence, not per beam, and read once per step for all its beams.

    mask: bool[k batch, K*T, kv_len] when K > 1. Returns (out [q batch, T, N, H],
    weights float32[q batch, N, T, kv_len]) as `cached_attention`.
    """
    (bq, t, n, h), b = q.shape, k.shape[0]
    if bq == b:
        return cached_attention(q, k, v, mask)
    beams = bq // b
    out, weights = cached_attention(q.reshape(b, beams * t, n, h), k, v, mask)
    weights = weights.reshape(b, n, beams, t, -1).swapaxes(1, 2).reshape(bq, n, t, -1)
    return out.reshape(bq, t, n, -1), weights


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The probabilities of `batched_attention` alone: float32[batch, heads, q_len, kv_len].

    For the fast path, which does not return them; the same formula as the
    core (scaled scores, masked with finfo.min, softmax in float32).
    """
    scores = dot_f32("bthd,bshd->bhts", q, k)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    if mask is not None:
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


# ----------------------------------------------------------------------------
# Multi-head attention module.
# ----------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Multi-head attention with per-head W_Q, W_K, W_V and the output W_O (§3.2.2).

    For self-attention the three projections are stored as one
    [D, 3, N, H] kernel (each [D, N, H] slice a per-head W_Q, W_K or W_V). For
    cross-attention W_Q is [D, N, H] and W_K, W_V are stacked as [D, 2, N, H]:
    `project_kv` projects the encoder side once per source, and decoding
    reuses the result at every step. The stacked kernel is applied as ONE
    [M, D] x [D, N*3*H] matmul (`layers.project`) after moving the heads axis
    in front of the stacking axis ([D, N, 3, H]; a 3 MB copy of the weights):
    one wide matmul runs faster on CPU than three [D, N*H] ones (docs/results.md, design decisions),
    and with the heads outermost in the merged
    axis a heads sharding over the mesh's model axis carries through the
    reshape, so tensor parallelism gathers no kernel.
    """

    config: TransformerConfig
    self_attention: bool
    capture: bool = False  # sow the attention probabilities into "intermediates"

    def _kernel(self, name: str, shape, axes, in_axis, out_axis, batch_axis=()):
        # Glorot-uniform with fans computed as for one [D, N*H] matrix per
        # projection: the head split and the q/k/v stacking do not change scale.
        init = nn.initializers.variance_scaling(
            1.0, "fan_avg", "uniform", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
        )
        return self.param(
            name, nn.with_logical_partitioning(init, axes), shape, self.config.param_dtype
        )

    def _bias(self, name: str, shape, axes):
        init = nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)
        return self.param(name, init, shape, self.config.param_dtype)

    def setup(self):
        cfg = self.config
        d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
        stacked = ("embed", "qkv", "heads", "kv")
        if self.self_attention:
            self.qkv_kernel = self._kernel("qkv_kernel", (d, 3, n, h), stacked, 0, (2, 3), (1,))
            self.qkv_bias = self._bias("qkv_bias", (3, n, h), ("qkv", "heads", "kv"))
        else:
            self.q_kernel = self._kernel("q_kernel", (d, n, h), ("embed", "heads", "kv"), 0, (1, 2))
            self.q_bias = self._bias("q_bias", (n, h), ("heads", "kv"))
            self.kv_kernel = self._kernel("kv_kernel", (d, 2, n, h), stacked, 0, (2, 3), (1,))
            self.kv_bias = self._bias("kv_bias", (2, n, h), ("qkv", "heads", "kv"))
        self.out_kernel = self._kernel("out_kernel", (n, h, d), ("heads", "kv", "embed"), (0, 1), 2)
        self.out_bias = self._bias("out_bias", (d,), ("embed",))
        self.dropout = Dropout(cfg.attention_dropout_rate, cfg.dropout_rng)

    def project_kv(self, inputs_kv: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Projects the encoder output to cross-attention keys and values.

        Args:
          inputs_kv: [batch, kv_len, d_model].
        Returns:
          (keys, values), each [batch, kv_len, heads, head_dim].
        """
        dt = self.config.dtype
        x = inputs_kv.astype(dt)
        w, b = self.kv_kernel.astype(dt), self.kv_bias.astype(dt)
        # [D, 2, N, H] -> [D, N, 2, H]: one matmul whose merged output axis
        # starts with the heads, so a heads sharding carries over.
        kv = project(x, w.transpose(0, 2, 1, 3)) + b.transpose(1, 0, 2)  # [B, S, N, 2, H]
        return kv[..., 0, :], kv[..., 1, :]

    def __call__(
        self,
        inputs_q: jax.Array,
        mask: jax.Array | AttentionMask | LocalMask | None,
        *,
        deterministic: bool,
        inputs_kv: jax.Array | None = None,
        cross_kv: tuple[jax.Array, jax.Array] | None = None,
        cache: dict | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """Attends from `inputs_q` to `inputs_kv` (to itself when self-attention).

        With `capture` set and the "intermediates" collection mutable, the
        attention probabilities float32[batch, heads, q_len, kv_len] are sown
        as "attention_weights" (on every path: a kernel that does not return
        them is then complemented by the same softmax computed here).

        Args:
          inputs_q: [batch, q_len, d_model].
          mask: a `masks.AttentionMask` (what the model passes: fused kernels read its
            structure, `kernels.py`), a dense bool[batch, q_len, kv_len] (kv_len = cache
            length with a cache), or for windowed self-attention a `masks.LocalMask`.
            A window runs the blocked O(n * r) kernel on XLA (`local_attention.py`), and
            `capture` scatters its weights into the dense [batch, heads, q_len, q_len]
            layout.
          deterministic: disables attention dropout.
          inputs_kv: cross-attention only: [batch, kv_len, d_model] encoder output
            (unused when `cross_kv` is given).
          cross_kv: cross-attention only, decoding: the `project_kv` output in the
            decoding layout, keys [batch, heads, head_dim, kv_len] and values [batch,
            heads, kv_len, head_dim] (`cached_attention`).
          cache: self-attention only: {"k": [batch, heads, head_dim, max_len], "v":
            [batch, heads, max_len, head_dim], "index": int32 scalar}. The new keys and
            values are written at [index, index + q_len) and attention runs over the
            whole cache
            (`cached_attention`; no dropout: decoding is deterministic).
        Returns:
          (output [batch, q_len, d_model], the updated cache or None).
        """
        cfg = self.config
        dt = cfg.dtype
        q, k, v, new_cache = self._qkv(inputs_q.astype(dt), inputs_kv, cross_kv, cache)
        capture = self.capture and self.is_mutable_collection("intermediates")
        dropout = cfg.attention_dropout_rate > 0.0 and not deterministic
        if cache is not None or cross_kv is not None:  # decoding: k [B, N, H, S], v [B, N, S, H]
            out, weights = _beams_over_one_source(q, k, v, dense(mask))
            if capture:
                self.sow("intermediates", "attention_weights", weights)
        else:
            q, k, v = (constrain(a, HEADS) for a in (q, k, v))
            out = self._teacher_forced(q, k, v, mask, capture, dropout)
        y = project(out, self.out_kernel.astype(dt), in_dims=2)  # btnh,nhd->btd
        return y + self.out_bias.astype(dt), new_cache

    def _teacher_forced(self, q, k, v, mask, capture: bool, dropout: bool) -> jax.Array:
        """[B, T, N, H] queries over [B, S, N, H] keys/values -> [B, T, N, H], on the kernel
        `kernels.choose` picks (one line says which, and why, per distinct path)."""
        if isinstance(mask, LocalMask):
            return self._local(q, k, v, mask, capture, dropout)
        choice = kernels.choose(self.config.attention_impl, q, k, mask, dropout=dropout)
        kernels.report(choice, self._where(mask))
        if choice.fused:
            out = kernels.run(choice, q, k, v, mask)
            if capture:
                self.sow("intermediates", "attention_weights", attention_weights(q, k, dense(mask)))
            return out
        if isinstance(mask, AttentionMask) and mask.window:
            return self._local(q, k, v, mask.local(), capture, dropout)
        mask = dense(mask)
        if choice.kernel == "fast" and not dropout:
            out = fast_attention(q, k, v, mask)  # [B, T, N, H]
            if capture:
                self.sow("intermediates", "attention_weights", attention_weights(q, k, mask))
            return out
        out, weights = batched_attention(q, k, v, mask)
        if capture:
            self.sow("intermediates", "attention_weights", weights)
        if dropout:
            dropped = self.dropout(weights, deterministic=False)
            out = jnp.einsum("bnts,bsnh->btnh", dropped.astype(q.dtype), v)
        return out

    def _where(self, mask) -> str:
        if not self.self_attention:
            return "cross-attention"
        causal = isinstance(mask, AttentionMask | LocalMask) and mask.causal
        return "decoder self-attention" if causal else "self-attention"

    def _local(self, q, k, v, mask: LocalMask, capture: bool, dropout: bool) -> jax.Array:
        """Windowed self-attention: [B, T, N, H] -> [B, T, N, H]."""
        out, weights = local_attention.local_attention(
            q, k, v, mask.valid, mask.segments, mask.window, mask.causal
        )  # weights float32[B, N, K, C, W]
        if capture:
            dense = local_attention.to_dense(weights, q.shape[1], mask.window, mask.causal)
            self.sow("intermediates", "attention_weights", dense)
        if dropout:
            dropped = self.dropout(weights, deterministic=False)
            out = local_attention.local_combine(dropped, v, mask.window, mask.causal)
        return out

    def _qkv(self, x, inputs_kv, cross_kv, cache):
        """Queries, keys and values [B, *, N, H] (and the updated cache or None)."""
        dt = self.config.dtype
        if not self.self_attention:
            q = project(x, self.q_kernel.astype(dt))  # btd,dnh->btnh
            q = q + self.q_bias.astype(dt)  # [B, T, N, H]
            k, v = cross_kv if cross_kv is not None else self.project_kv(inputs_kv)
            return q, k, v, None
        w, b = self.qkv_kernel.astype(dt), self.qkv_bias.astype(dt)
        if cache is None:
            # As in project_kv: one [M, D] x [D, N*3*H] matmul, heads outermost.
            qkv = project(x, w.transpose(0, 2, 1, 3)) + b.transpose(1, 0, 2)  # [B, T, N, 3, H]
            q, k, v = (qkv[..., i, :] for i in range(3))  # each [B, T, N, H]
            return q, k, v, None
        # A decoding step is bound by reading the weights: one matmul over the kernel as
        # it lies ([D, 3, N, H] merges to [D, 3*N*H] for free); slicing the kernel per
        # projection made XLA copy the slices at every step.
        qkv = project(x, w) + b  # [B, T, 3, N, H]
        q, k, v = (qkv[:, :, i] for i in range(3))  # each [B, T, N, H]
        i = cache["index"]  # keys [B, N, H, L], values [B, N, L, H]
        k = k.transpose(0, 2, 3, 1).astype(cache["k"].dtype)  # [B, N, H, T]
        v = v.swapaxes(1, 2).astype(cache["v"].dtype)  # [B, N, T, H]
        if i.ndim:  # int32[B]: each row writes at its own position (a continuous batch)
            write = jax.vmap(jax.lax.dynamic_update_slice_in_dim, in_axes=(0, 0, 0, None))
            k, v = write(cache["k"], k, i, 2), write(cache["v"], v, i, 1)
        else:
            k = jax.lax.dynamic_update_slice(cache["k"], k, (0, 0, 0, i))
            v = jax.lax.dynamic_update_slice(cache["v"], v, (0, 0, i, 0))
        return q, k, v, {"k": k, "v": v, "index": cache["index"] + x.shape[1]}
