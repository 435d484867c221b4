"""The encoder and decoder layers, and running a stack of them as one `lax.scan`.

Each layer is straight-line code: sub-layers in residual + LayerNorm
wrappers, masks passed in (built once per pass, `nn/masks.py`), attention
probabilities leaving through flax's "intermediates" collection (`capture`),
and a decoder cache returned explicitly. Letter legend as in `nn/attention.py`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import LazyRng

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn import attention
from flaxformer_lite.nn.dropout import KEYS
from flaxformer_lite.nn.layers import FeedForward, Residual


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward sub-layers, each in a residual + LayerNorm."""

    config: TransformerConfig
    capture_self: bool = False  # sow the self-attention probabilities

    # Module paths of this layer's Dropout modules (see `scan_layers`).
    DROPOUT_SITES = (
        ("self_attention", "dropout"),
        ("self_attention_residual", "Dropout_0"),
        ("ffn_residual", "Dropout_0"),
    )

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, S, D]; mask: bool[B, S, S] or a `masks.LocalMask`. Returns [B, S, D]."""
        cfg = self.config
        attn = attention.MultiHeadAttention(
            cfg, self_attention=True, capture=self.capture_self, name="self_attention"
        )
        res = Residual(cfg, name="self_attention_residual")
        y, _ = attn(res.inputs(x), mask, deterministic=deterministic)
        x = res(x, y, deterministic=deterministic)
        res = Residual(cfg, name="ffn_residual")
        y = FeedForward(cfg, name="ffn")(res.inputs(x))
        return res(x, y, deterministic=deterministic)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward."""

    config: TransformerConfig
    capture_self: bool = False  # sow the self-attention probabilities
    capture_cross: bool = False  # sow the cross-attention probabilities

    DROPOUT_SITES = EncoderLayer.DROPOUT_SITES + (
        ("cross_attention", "dropout"),
        ("cross_attention_residual", "Dropout_0"),
    )

    def setup(self):
        cfg = self.config
        self.self_attention = attention.MultiHeadAttention(
            cfg, self_attention=True, capture=self.capture_self
        )
        self.self_attention_residual = Residual(cfg)
        self.cross_attention = attention.MultiHeadAttention(
            cfg, self_attention=False, capture=self.capture_cross
        )
        self.cross_attention_residual = Residual(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_residual = Residual(cfg)

    def __call__(
        self,
        y: jax.Array,
        encoded: jax.Array | None,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        *,
        deterministic: bool,
        cache: dict | None = None,
        cross_kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """Runs one decoder layer.

        Args:
          y: [B, T, D] decoder activations.
          encoded: [B, S, D] encoder output (unused when `cross_kv` is given).
          self_mask: bool[B, T, T] (or a `masks.LocalMask`), or bool[B, T, L] with a cache.
          cross_mask: bool[B, T, S].
          cache: this layer's {"k", "v", "index"} (layout in `models/transformer.py`).
          cross_kv: this layer's precomputed cross-attention (k, v).
        Returns:
          (y [B, T, D], the updated cache or None).
        """
        res = self.self_attention_residual
        h, new_cache = self.self_attention(
            res.inputs(y), self_mask, deterministic=deterministic, cache=cache
        )
        y = res(y, h, deterministic=deterministic)
        res = self.cross_attention_residual
        h, _ = self.cross_attention(
            res.inputs(y),
            cross_mask,
            deterministic=deterministic,
            inputs_kv=encoded,
            cross_kv=cross_kv,
        )
        y = res(y, h, deterministic=deterministic)
        res = self.ffn_residual
        y = res(y, self.ffn(res.inputs(y)), deterministic=deterministic)
        return y, new_cache


def _unrolled_dropout_keys(parent: nn.Module, sites, num_layers: int) -> dict:
    """The key each Dropout module of layer i would draw when the layers run unrolled.

    flax derives a module's key from the stream's root key and the module's
    whole path (`LazyRng`); under the scan a layer is applied unbound, so the
    keys are derived here, [L] per site, and handed to `Dropout` through the
    "dropout_keys" collection. Scanned and unrolled runs then drop the same
    units, and a resume may flip `scan_layers`.
    """
    base = parent.scope.rngs["dropout"]
    tree: dict = {}
    for site in sites:
        keys = [
            LazyRng.create(base, f"layer_{i}", *site, 1).as_jax_rng() for i in range(num_layers)
        ]  # the counter is 1: each Dropout module draws once per call
        node = tree
        for name in site:
            node = node.setdefault(name, {})
        node["key"] = jnp.stack(keys)
    return tree


def scan_layers(
    parent: nn.Module,
    layer: nn.Module,
    num_layers: int,
    x: jax.Array,
    args: tuple,
    deterministic: bool,
    capture: tuple[int, ...] = (),
    first=lambda out: out,
) -> jax.Array:
    """Runs `num_layers` identical layers as one `lax.scan` over their stacked parameters.

    The parameters keep their per-layer layout (`layer_0`, `layer_1`, ...), so
    checkpoints are the same with or without scanning; they are stacked here,
    [L, ...] per leaf, and the layer body is compiled once instead of L times.
    With `config.remat` each layer's activations are recomputed in the
    backward pass instead of stored.

    Args:
      parent: the bound stack module (its params hold `layer_i`).
      layer: an unbound layer (e.g. `EncoderLayer(cfg, capture_self=True)`).
      x: [B, T, D] input of the first layer.
      args: the layer's other positional inputs (encoder output, masks), the
        same for every layer.
      capture: layers whose sown intermediates are re-sown on `parent` as
        "scanned_layer_{i}" (every layer's are computed inside the scan).
      first: picks the activations from a layer's output.
    Returns:
      [B, T, D] output of the last layer.
    """
    params = parent.variables["params"]
    stacked = jax.tree.map(
        lambda *p: jnp.stack(p), *[params[f"layer_{i}"] for i in range(num_layers)]
    )
    keys = (
        None if deterministic else _unrolled_dropout_keys(parent, layer.DROPOUT_SITES, num_layers)
    )
    mutable = ["intermediates"] if capture else False

    def body(h, xs):
        layer_params, layer_keys = xs
        variables = {"params": layer_params}
        if layer_keys is not None:
            variables[KEYS] = layer_keys
        out = layer.apply(variables, h, *args, deterministic=deterministic, mutable=mutable)
        if capture:
            out, sown = out
            return first(out), sown["intermediates"]
        return first(out), None

    if parent.config.remat:
        body = jax.checkpoint(body)
    y, sown = jax.lax.scan(body, x, (stacked, keys))
    for i in capture:
        layer_sown = jax.tree.map(lambda s, i=i: s[i], sown)
        parent.sow("intermediates", f"scanned_layer_{i}", layer_sown)
    return y
