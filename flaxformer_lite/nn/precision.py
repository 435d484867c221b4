"""Matmuls whose result is float32 while their operands stay in the compute dtype.

Attention scores and the vocabulary logits feed a float32 softmax, so they are computed
with `preferred_element_type=float32`: the accelerator multiplies bf16 operands and
accumulates in float32, and no rounding to bf16 happens before the softmax. JAX's
gradient of such a product, though, multiplies the float32 cotangent by the other
operand upcast to float32: on a GPU or TPU the two backward matmuls of every attention
layer and of the [B*T, D] x [D, V] vocabulary projection then run as float32 x float32,
at a fraction of the bf16 rate (a TPU runs them as several bf16 passes, an H100/H200 as
TF32 or slower). `dot_f32` keeps the forward product and rounds the cotangent to the
operands' dtype first, so the backward matmuls also run bf16 x bf16 (accumulating in
float32 on GPUs and TPUs), as in mixed-precision training everywhere: the gradient
reaching a bf16 operand is rounded to bf16 anyway. With float32 operands it is a plain
einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def dot_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(subscripts, a, b)` with a float32 result; backward matmuls in a's dtype.

    Args:
      subscripts: a two-operand einsum, e.g. "btnh,bsnh->bnts".
      a, b: operands of the same dtype (the compute dtype).
    Returns:
      float32 array of the einsum's shape.
    """
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)
    return _low_precision_dot(subscripts, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _low_precision_dot(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _forward(subscripts, a, b):
    return _low_precision_dot(subscripts, a, b), (a, b)


def _backward(subscripts, residuals, g):
    a, b = residuals
    a_sub, b_sub, out_sub = _parse(subscripts)
    # The cotangent in the operands' dtype: the transposed products are then bf16 x bf16
    # matmuls with bf16 results, which GPUs (cuBLAS/cuDNN compute type float32) and TPUs
    # (the MXU) accumulate in float32 before rounding once. (A float32 result type is not
    # portable: XLA:CPU cannot run every bf16 x bf16 -> f32 dot it lays out.)
    g = g.astype(a.dtype)
    da = jnp.einsum(f"{out_sub},{b_sub}->{a_sub}", g, b, preferred_element_type=a.dtype)
    db = jnp.einsum(f"{out_sub},{a_sub}->{b_sub}", g, a, preferred_element_type=b.dtype)
    return da, db


def _parse(subscripts: str) -> tuple[str, str, str]:
    """ "ab,cb->ac" -> ("ab", "cb", "ac"); every index of an operand must appear in the other
    operand or in the output (no index summed out of a single operand), which makes the
    transposes einsums of the cotangent with the other operand."""
    inputs, out = subscripts.replace(" ", "").split("->")
    a, b = inputs.split(",")
    for x, other in ((a, b), (b, a)):
        if any(c not in other and c not in out for c in x) or len(set(x)) != len(x):
            raise ValueError(f"dot_f32 does not support the einsum {subscripts!r}")
    return a, b, out


_low_precision_dot.defvjp(_forward, _backward)


def describe(model_cfg, state_dtype: str = "float32") -> str:
    """One line: the run's precision policy and attention kernel, as the CLIs print it."""
    from flaxformer_lite.nn import kernels

    name = lambda dtype: jnp.dtype(dtype).name
    choice = kernels.platform_choice(model_cfg.attention_impl)
    kernel = {"cudnn": "cuDNN flash attention", "splash": "Pallas splash attention"}.get(
        choice.kernel, "XLA"
    )
    return (
        f"precision: {name(model_cfg.dtype)} matmul operands (float32 accumulation), "
        f"{name(model_cfg.param_dtype)} parameters, {name(state_dtype)} optimizer state; "
        f"softmax, LayerNorm statistics and loss in float32; attention: {kernel} where its "
        f"constraints hold ({choice.why}), else XLA"
    )
