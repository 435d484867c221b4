"""The train state, created abstractly first and then directly into its shardings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from flaxformer_lite.models import layer_layout
from flaxformer_lite.models.base import Seq2SeqModel
from flaxformer_lite.parallel import partitioning


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs. Pytree of arrays only (the optimiser is static)."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any  # model parameters
    opt_state: Any  # optimiser moments
    rng: jax.Array  # uint32[2] base key for dropout; step keys are folded in


def init_shapes(model: Seq2SeqModel, source_len: int, target_len: int) -> dict[str, tuple]:
    """The batch shapes `model.init` builds parameters from: a feature encoder reads
    float[1, S, F] frames, the others int[1, S] ids."""
    features = getattr(getattr(model, "config", None), "input_features", 0)
    inputs = (1, source_len, features) if features else (1, source_len)
    return {"inputs": inputs, "targets": (1, target_len)}


def _init_fn(
    model: Seq2SeqModel,
    tx: optax.GradientTransformation,
    seed: int,
    source_len: int,
    target_len: int,
) -> Callable[[], TrainState]:
    def init() -> TrainState:
        params_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
        params = model.init(params_rng, init_shapes(model, source_len, target_len))
        return TrainState(jnp.int32(0), params, tx.init(params), dropout_rng)

    return init


ParamShapes = dict[str, tuple[tuple[int, ...], str]]


def param_shapes(model: Seq2SeqModel) -> ParamShapes:
    """{parameter path: (shape, dtype name)} of `model`, from `jax.eval_shape` (no allocation).

    Paths join module names with "/", e.g. "decoder/layer_0/cross_attention/kv_kernel".
    Parameter shapes do not depend on the lengths: a [1, 8] source and target suffice.
    Layers are listed unrolled also when stored stacked (`models/layer_layout.py`): the
    layout is no property of the model, and checkpoints of either restore into the other.
    """
    shapes = init_shapes(model, 8, 8)
    params = jax.eval_shape(
        lambda rng: model.init(rng, shapes), jax.ShapeDtypeStruct((2,), jnp.uint32)
    )
    out = {}
    unrolled = layer_layout.unstack(nn.meta.unbox(params))
    for path, leaf in jax.tree_util.tree_flatten_with_path(unrolled)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        out[name] = (tuple(int(n) for n in leaf.shape), jnp.dtype(leaf.dtype).name)
    return out


def abstract_state(model: Seq2SeqModel, tx, seed: int, source_len: int, target_len: int):
    """Shapes of the train state, with logical-axis boxes, without allocating."""
    return jax.eval_shape(_init_fn(model, tx, seed, source_len, target_len))


def create_state(model: Seq2SeqModel, tx, mesh, *, seed: int, source_len: int, target_len: int):
    """Initialises the state directly into its shardings. Returns (state, shardings)."""
    init = _init_fn(model, tx, seed, source_len, target_len)
    shardings = partitioning.logical_shardings(jax.eval_shape(init), mesh)
    state = jax.jit(lambda: nn.meta.unbox(init()), out_shardings=shardings)()
    return state, shardings
