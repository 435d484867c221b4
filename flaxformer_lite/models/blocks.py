"""The encoder and decoder layers, running a stack of them as one `lax.scan`, and remat.

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
from flaxformer_lite.models.layer_layout import STACKED
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


_POLICIES = {
    "full": None,  # jax.checkpoint's default: only the layer's inputs are kept
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def rematerialized(fn, config: TransformerConfig, *, module: bool = False):
    """`fn` recomputing its forward pass in the backward one as `config.remat` says.

    "none" returns `fn` itself. With `module`, `fn(module, *args)` takes a bound
    layer (flax's lifted `nn.remat`); otherwise `fn` is pure (`jax.checkpoint`,
    without the CSE barrier: inside `lax.scan` the loop already keeps XLA from
    merging the recomputation with the forward pass).
    """
    if config.remat == "none":
        return fn
    policy = _POLICIES[config.remat]
    if module:
        return nn.remat(fn, policy=policy)
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def check_layout(stack: nn.Module) -> None:
    """Raises ValueError, naming the conversion, if a stack's parameters are in the other
    layout than its `config.scan_layers` reads (flax would only say one is missing)."""
    if stack.is_initializing():
        return
    scanned = stack.config.scan_layers
    other = "layer_0" if scanned else STACKED
    if stack.has_variable("params", other):
        raise ValueError(
            f"{stack.name}: the parameters hold the layers "
            f"{'unrolled' if scanned else 'stacked'} but model.scan_layers={scanned}; "
            f"convert them with models.layer_layout.to_layout(params, scanned={scanned})"
        )


def init_stacked(layer: nn.Module, num_layers: int, example: tuple):
    """The init function of a stack's parameters stored stacked: [L, ...] per leaf.

    Each layer is initialised as it would be alone, from its own key, and the
    logical names gain `layer_layout.STACKED` for the leading axis (unsharded:
    `parallel/partitioning.py`).

    Args:
      layer: an unbound layer (`parent=None`).
      example: positional inputs that initialise it (shapes [1, 1, D]: the
        parameters do not depend on lengths).
    """

    def init(rng: jax.Array):
        def one(key):
            return layer.init({"params": key}, *example, deterministic=True)["params"]

        params = jax.vmap(one)(jax.random.split(rng, num_layers))
        return jax.tree.map(
            lambda p: (
                p.add_axis(0, {nn.PARTITION_NAME: STACKED})
                if isinstance(p, nn.meta.AxisMetadata)
                else p
            ),
            params,
            is_leaf=lambda p: isinstance(p, nn.meta.AxisMetadata),
        )

    return init


def scan_layers(
    parent: nn.Module,
    layer: nn.Module,
    stacked: dict,
    x: jax.Array,
    args: tuple,
    deterministic: bool,
    capture: tuple[int, ...] = (),
    first=lambda out: out,
) -> jax.Array:
    """Runs identical layers as one `lax.scan` over their parameters, stored stacked.

    The scan reads each leaf [L, ...] as it is stored (`layer_layout`), so
    nothing is copied per call, and the layer body is compiled once instead
    of L times. With `config.remat` each layer's activations are recomputed
    in the backward pass as its policy says (`rematerialized`).

    Args:
      parent: the bound stack module (draws the dropout keys, re-sows captures).
      layer: an unbound layer (e.g. `EncoderLayer(cfg, capture_self=True)`).
      stacked: the layers' parameters, [L, ...] per leaf.
      x: [B, T, D] input of the first layer.
      args: the layer's other positional inputs (encoder output, masks), the
        same for every layer.
      capture: layers whose sown intermediates are re-sown on `parent` as
        "scanned_layer_{i}" (every layer's are computed inside the scan).
      first: picks the activations from a layer's output.
    Returns:
      [B, T, D] output of the last layer.
    """
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
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

    body = rematerialized(body, parent.config)
    y, sown = jax.lax.scan(body, x, (stacked, keys))
    for i in capture:
        layer_sown = jax.tree.map(lambda s, i=i: s[i], sown)
        parent.sow("intermediates", f"scanned_layer_{i}", layer_sown)
    return y
