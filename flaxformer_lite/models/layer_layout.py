"""The two layouts of a layer stack's parameters, and the conversion between them.

Unrolled (`model.scan_layers=False`), each layer has its own subtree:

  {"layer_0": {"self_attention": {"qkv_kernel": [D, 3, N, H], ...}, ...}, "layer_1": ...}

Scanned (`model.scan_layers=True`), the stack holds one subtree whose leaves
carry a leading layer axis, so the scan reads them as they are stored:

  {"layers": {"self_attention": {"qkv_kernel": [L, D, 3, N, H], ...}, ...}}

The conversion applies to any tree that holds stacks (parameters, Adam's
moments, a train state, shapes for a restore target): every dict with
`layer_0`, `layer_1`, ... or with `STACKED` is converted, the rest is kept.
It lets a checkpoint written in one layout restore into a model built with
the other, and export read a scanned model layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STACKED = "layers"  # the stacked subtree's name, and the logical name of its leading axis


def _layer_names(node: Mapping) -> list[str]:
    names = []
    while f"layer_{len(names)}" in node:
        names.append(f"layer_{len(names)}")
    return names


def _is_stack(node: Any) -> bool:
    return isinstance(node, Mapping) and ("layer_0" in node or STACKED in node)


def is_stacked(tree: Any) -> bool | None:
    """True if `tree` holds its layers stacked, False if unrolled, None if it has no stack."""
    stacks = [n for n in jax.tree.leaves(tree, is_leaf=_is_stack) if _is_stack(n)]
    return (STACKED in stacks[0]) if stacks else None


def _stack_leaves(*leaves):
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            (len(leaves), *first.shape), first.dtype, sharding=_add_axis(first.sharding)
        )
    if isinstance(first, np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _layer_leaf(leaf, index: int):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=_drop_axis(leaf.sharding))
    return leaf[index]


def _add_axis(sharding):
    """A NamedSharding of a layer's leaf -> the stacked leaf's (the layer axis replicated)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
        )
    return sharding


def _drop_axis(sharding):
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:])
        )
    return sharding


def _convert(tree: Any, change: Callable[[Mapping], dict]) -> Any:
    return jax.tree.map(lambda n: change(n) if _is_stack(n) else n, tree, is_leaf=_is_stack)


def stack(tree: Any) -> Any:
    """Every unrolled stack in `tree` ({"layer_i": subtree}) -> {STACKED: [L, ...] leaves}."""

    def change(node: Mapping) -> dict:
        names = _layer_names(node)
        if not names:
            return dict(node)
        rest = {k: v for k, v in node.items() if k not in names}
        stacked = jax.tree.map(_stack_leaves, *[node[n] for n in names])
        return {**rest, STACKED: stacked}

    return _convert(tree, change)


def unstack(tree: Any) -> Any:
    """Every stacked stack in `tree` ({STACKED: [L, ...] leaves}) -> {"layer_i": subtree}."""

    def change(node: Mapping) -> dict:
        if STACKED not in node:
            return dict(node)
        rest = {k: v for k, v in node.items() if k != STACKED}
        stacked = node[STACKED]
        count = jax.tree.leaves(stacked)[0].shape[0]
        layers = {
            f"layer_{i}": jax.tree.map(lambda leaf, i=i: _layer_leaf(leaf, i), stacked)
            for i in range(count)
        }
        return {**rest, **layers}

    return _convert(tree, change)


def to_layout(tree: Any, scanned: bool) -> Any:
    """`tree` with its stacks in the layout a model with `scan_layers=scanned` reads."""
    return stack(tree) if scanned else unstack(tree)


def layer(tree: Mapping, index: int) -> Any:
    """Layer `index`'s subtree of one stack, in either layout (a slice when stacked)."""
    if STACKED in tree:
        return jax.tree.map(lambda p: p[index], tree[STACKED])
    return tree[f"layer_{index}"]
