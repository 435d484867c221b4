"""Learning-rate schedules and the optimiser (paper §5.3 by default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.config.sections import SCHEDULES, OptimConfig


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (§5.3, eq. 3).

    Steps are counted from 1 (optax passes the 0-based update count, so the
    first update uses step 1 and the rate is never 0).
    """

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def make_schedule(
    name: str, *, d_model: int, warmup_steps: int, learning_rate: float, total_steps: int
) -> optax.Schedule:
    """Builds the schedule named in the run config.

    rsqrt: the paper's formula, multiplied by `learning_rate` (1.0 = the paper).
    constant: linear warm-up to `learning_rate`, then constant.
    cosine: linear warm-up to `learning_rate`, cosine decay to 0 at `total_steps`.
    """
    if warmup_steps < 0 or (name == "rsqrt" and warmup_steps == 0):
        raise ConfigError(f"optim.warmup_steps must be positive, got {warmup_steps}")
    if name == "rsqrt":
        return paper_schedule(d_model, warmup_steps, learning_rate)
    if name == "constant":
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                optax.constant_schedule(learning_rate),
            ],
            [max(warmup_steps, 1)],
        )
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1)
        )
    raise ConfigError(f"optim.schedule={name!r} is not one of {', '.join(SCHEDULES)}")


def make_optimizer(
    schedule: optax.Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-9,
    weight_decay: float = 0.0,
    grad_clip_norm: float = 0.0,
) -> optax.GradientTransformation:
    """Adam(b1, b2, eps) as in §5.3, optional decoupled weight decay and global-norm clipping."""
    parts = []
    if grad_clip_norm > 0.0:
        parts.append(optax.clip_by_global_norm(grad_clip_norm))
    if weight_decay > 0.0:
        parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    else:
        parts.append(optax.adam(schedule, b1=b1, b2=b2, eps=eps))
    return optax.chain(*parts)


def in_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` keeping its state and computing its update in `dtype`, whatever the
    parameters' dtype: gradients and parameters are cast to `dtype` on the way in and the
    update back to each parameter's dtype on the way out.

    float32 moments for bfloat16 parameters keep Adam's second moment (squares of small
    gradients) from flushing to bf16's coarse grid; bfloat16 moments for float32
    parameters halve the optimiser's memory.
    """
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)

    def init(params):
        return inner.init(cast(params))

    def update(updates, state, params=None):
        dtypes = jax.tree.map(lambda u: u.dtype, updates)
        new, state = inner.update(cast(updates), state, None if params is None else cast(params))
        return jax.tree.map(lambda u, d: u.astype(d), new, dtypes), state

    return optax.GradientTransformation(init, update)


def from_config(
    optim: OptimConfig, *, d_model: int, param_dtype, total_steps: int
) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """(schedule, optimiser) of a run's `optim` section for a model of `d_model` whose
    parameters are stored in `param_dtype`, trained for `total_steps`."""
    schedule = make_schedule(
        optim.schedule,
        d_model=d_model,
        warmup_steps=optim.warmup_steps,
        learning_rate=optim.learning_rate,
        total_steps=total_steps,
    )
    tx = make_optimizer(
        schedule,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        grad_clip_norm=optim.grad_clip_norm,
    )
    state_dtype = jnp.dtype(optim.state_dtype)
    if state_dtype != jnp.dtype(param_dtype):
        tx = in_dtype(tx, state_dtype)
    return schedule, tx


def of_run(run: RunConfig) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """`from_config` for a whole `RunConfig`: its model and `train.num_steps`."""
    return from_config(
        run.optim,
        d_model=run.model.d_model,
        param_dtype=run.model.param_dtype,
        total_steps=run.train.num_steps,
    )
