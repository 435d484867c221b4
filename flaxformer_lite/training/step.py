"""The jitted train and evaluation steps, written against the model protocol only."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxformer_lite.models.base import Seq2SeqModel
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training.state import TrainState

# The train step's "nonfinite" codes.
NONFINITE_WHAT = {1: "gradient norm", 2: "loss", 3: "update"}


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    model: Seq2SeqModel,
    tx: optax.GradientTransformation,
    grad_accum_steps: int = 1,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One update with the gradient of `model.loss`.

    The gradient is that of the per-token mean loss over the whole batch. With
    `grad_accum_steps` > 1 the batch is split into that many micro-batches run
    one after another by `lax.scan` (activation memory of one micro-batch); the
    summed gradients are divided by the batch's token count once, so the update
    equals the one-batch update.

    Args:
      batch: the model's batch (`models/base.py`): "inputs" int32[B, S],
        "targets" int32[B, T], packing fields for packed rows. B must be
        divisible by `grad_accum_steps`.
    Returns:
      (new state, metric sums as float32 scalars, plus "grad_norm" and "nonfinite":
      0.0 for a finite step, else what was not finite: 2.0 the loss, 1.0 the
      gradient norm, 3.0 the update (`NONFINITE_WHAT`). Then the
      parameters and optimiser state are returned unchanged, the step counter
      advances, and the other sums are 0).
    """
    rng = jax.random.fold_in(state.rng, state.step)
    grad_fn = jax.grad(
        lambda params, mb, key: model.loss(params, mb, key, state.step), has_aux=True
    )
    if grad_accum_steps == 1:
        grads, sums = grad_fn(state.params, batch, rng)
    else:
        grads, sums = _accumulated_gradients(grad_fn, state.params, batch, rng, grad_accum_steps)
    grads = _per_token_mean(grads, sums, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return _guarded_update(state, params, opt_state, grads, updates, sums)


def _accumulated_gradients(grad_fn, params, batch, rng, n: int):
    """Summed gradients and metric sums of `batch` split into `n` micro-batches.

    `grad_fn(params, micro-batch, key) -> (gradients, sums)` runs once per micro-batch
    (rows [i * B / n, (i + 1) * B / n), key `fold_in(rng, i)`) inside one `lax.scan`;
    floating sums are kept in float32. Returns (gradients, sums) shaped as one call's.
    """
    micro = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

    def accumulate(carry, inputs):
        i, mb = inputs
        g, s = grad_fn(params, mb, jax.random.fold_in(rng, i))
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, (g, s)), None

    zeros = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro), rng))
    # Sums in float32 whatever the parameters' dtype: n bf16 additions would round n times.
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, _accumulator(x.dtype)), zeros)
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(n), micro))
    return grads, sums


def _per_token_mean(grads, sums, params):
    """Summed gradients divided by the batch's token count (at least 1), each leaf in its
    parameter's dtype."""
    # The mean over the batch's tokens, in float32, returned in each parameter's dtype: a
    # bf16 gradient divided by the float32 count would otherwise become float32 and turn
    # the optimiser's moments float32 too (the update and the kept state must match).
    tokens = jnp.maximum(sums["tokens"], 1.0)
    return jax.tree.map(lambda g, p: (g / tokens).astype(p.dtype), grads, params)


def _guarded_update(state: TrainState, params, opt_state, grads, updates, sums):
    """The next state and the step's metric sums, the update dropped if anything is not finite.

    `params` and `opt_state` are the updated ones, `grads` the per-token mean gradients,
    `updates` the optimiser's. Returns (state with step + 1, sums with "grad_norm" and the
    "nonfinite" code, as `train_step` documents).
    """
    grad_norm = optax.global_norm(grads)
    # A non-finite loss, gradient or update never reaches the state: the update
    # is dropped (the step still counts, so the data sequence is unchanged), and the loop
    # decides from the "nonfinite" code whether to stop or go on. Selecting the old state
    # is exact, so a finite step is bit-identical to an unguarded one. The selection is
    # per leaf (`jnp.where`), which XLA fuses into the optimiser's elementwise update: a
    # `lax.cond` over the whole state made XLA copy every parameter and moment into the
    # conditional's result at every step (1.16 GB of copies per base-model step).
    loss_ok = jnp.isfinite(sums["loss"])
    grad_ok = jnp.isfinite(grad_norm)
    # The update itself can overflow with a finite gradient (a huge learning rate): its
    # norm is one more reduction, much cheaper to compile than a check of every parameter.
    params_ok = jnp.isfinite(optax.global_norm(updates))
    finite = loss_ok & grad_ok & params_ok
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, params, state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    sums = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), sums)
    sums["grad_norm"] = jnp.where(finite, grad_norm, 0.0)
    code = jnp.where(loss_ok, jnp.where(grad_ok, jnp.where(params_ok, 0.0, 3.0), 1.0), 2.0)
    sums["nonfinite"] = code
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), sums


def _accumulator(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else dtype


def jit_train_step(
    model: Seq2SeqModel,
    tx: optax.GradientTransformation,
    mesh,
    state_shardings,
    *,
    grad_accum_steps=1,
):
    """`train_step` jitted on `mesh`: (state, batch) -> (new state, replicated metric sums).

    On accelerators the old state is donated, so parameters and optimiser
    moments are updated in place (one copy of the state in device memory).
    On CPU it is not: it gave no faster step there and fragmented the host
    heap (measurements in docs/results.md).
    """
    donate = () if mesh.devices.flat[0].platform == "cpu" else (0,)
    step = functools.partial(train_step, model=model, tx=tx, grad_accum_steps=grad_accum_steps)
    return jax.jit(
        _under_mesh(step, mesh),
        in_shardings=(state_shardings, partitioning.batch_sharding(mesh)),
        out_shardings=(state_shardings, partitioning.replicated(mesh)),
        donate_argnums=donate,
    )


def jit_eval_step(model: Seq2SeqModel, mesh):
    """`model.evaluate` jitted: (params, batch) -> metric sums, replicated on every process."""
    return jax.jit(_under_mesh(model.evaluate, mesh), out_shardings=partitioning.replicated(mesh))


def _under_mesh(fn, mesh):
    """fn traced with `mesh` in context, where the layers' activation constraints
    (`partitioning.constrain`) find it, and kernels XLA cannot partition (splash
    attention) run per device under `shard_map` (`nn/kernels.py`)."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def device_batch(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """The model's fields of this process's rows of a batch, as global arrays on the mesh.

    Everything but the host-side "valid" row flags goes to the devices.
    """
    return partitioning.put_batch({k: v for k, v in batch.items() if k != "valid"}, mesh)
