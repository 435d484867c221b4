"""Which kernel computes a teacher-forced attention, and the calls of the fused kernels.

`model.attention_impl`:

  auto    the platform's fused kernel where its constraints hold, else XLA:
          cuDNN flash attention on NVIDIA GPUs, Pallas splash attention on TPUs,
          XLA (the batched core of `attention.py`) on CPUs;
  vmap    XLA: the single-head core vmapped over heads and examples;
  fast    XLA: `jax.nn.dot_product_attention(implementation="xla")`;
  cudnn   cuDNN flash attention, NVIDIA GPUs only;
  splash  Pallas splash attention, TPUs only (Pallas interpret mode under
          `target("tpu", interpret=True)`, which tests use on a CPU).

The fused kernels never materialise the [B, N, T, S] scores: they read the mask as
structure (`masks.AttentionMask`): cuDNN takes the causal flag, key lengths and a causal
window; splash takes a static causal/local pattern and segment ids, which carry both
padding and packing. Where a kernel's constraints fail (float32 operands for cuDNN, a
head size or lengths it cannot tile, weights needed for dropout) the call falls back to
XLA, and one line names the path and why. Which platform a program is for is
`target_platform()`: the platform JAX runs on, or the one a `target(...)` context names
(lowering for a TPU from a CPU host).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import sys

import jax
import jax.numpy as jnp

from flaxformer_lite.config import ConfigError
from flaxformer_lite.nn.masks import AttentionMask

KERNEL_PLATFORMS = {"cudnn": "gpu", "splash": "tpu"}  # forced kernel -> the platform it needs
SPLASH_BLOCK = 128  # splash tiles queries and keys in blocks of (multiples of) 128 rows
CUDNN_MAX_HEAD_DIM = 128  # flash attention's head size limit before Hopper (256 on Hopper)


@dataclasses.dataclass(frozen=True)
class _Target:
    platform: str | None  # None: not known yet (`platform_unknown`)
    interpret: bool = False


_TARGET: contextvars.ContextVar[_Target | None] = contextvars.ContextVar("target", default=None)


@contextlib.contextmanager
def target(platform: str, *, interpret: bool = False):
    """Traces programs inside the block for `platform` ("cpu", "gpu", "tpu"): kernels are
    chosen for it, e.g. when lowering for a TPU from a CPU host. `interpret=True` runs
    Pallas kernels in interpret mode (numerics tests on a CPU). `jax.jit` caches traces
    without looking at the target: jit a new function object for each target."""
    token = _TARGET.set(_Target(_platform_name(platform), interpret))
    try:
        yield
    finally:
        _TARGET.reset(token)


@contextlib.contextmanager
def platform_unknown():
    """Config checks inside the block skip what depends on the platform: a multi-process
    job must not touch JAX's backends before `jax.distributed.initialize`, so train.py
    checks the rest of a config first and the platform's part after joining the job.
    `target_platform()` is None inside; "auto" dtypes resolve to a placeholder."""
    token = _TARGET.set(_Target(None))
    try:
        yield
    finally:
        _TARGET.reset(token)


def _platform_name(platform: str) -> str:
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def target_platform() -> str | None:
    """The platform programs are traced for: "cpu", "gpu" or "tpu" (None inside
    `platform_unknown`)."""
    t = _TARGET.get()
    return t.platform if t is not None else _platform_name(jax.default_backend())


def _interpret() -> bool:
    t = _TARGET.get()
    return t is not None and t.interpret


def check_platform(setting: str, platform: str | None = None) -> None:
    """Raises ConfigError when `setting` forces a kernel the platform does not have."""
    platform = platform or target_platform()
    need = KERNEL_PLATFORMS.get(setting)
    if need is not None and platform is not None and need != platform and not _interpret():
        raise ConfigError(
            f"model.attention_impl={setting!r} needs a {need.upper()}, but JAX runs on "
            f"{platform}; use model.attention_impl='auto' (picks the platform's kernel)"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel of one attention call, and why."""

    kernel: str  # "cudnn" | "splash" | "vmap" | "fast"
    why: str

    @property
    def fused(self) -> bool:
        return self.kernel in KERNEL_PLATFORMS


def platform_choice(setting: str, platform: str | None = None) -> Choice:
    """The kernel `setting` asks for on `platform`, before any shape is known."""
    platform = platform or target_platform()
    check_platform(setting, platform)
    if setting != "auto":
        return Choice(setting, f"model.attention_impl={setting!r}")
    if platform == "gpu":
        return Choice("cudnn", "auto on gpu")
    if platform == "tpu":
        return Choice("splash", "auto on tpu")
    return Choice("vmap", f"auto on {platform}: no fused attention kernel there")


def choose(
    setting: str,
    q: jax.Array,
    k: jax.Array,
    mask: AttentionMask | jax.Array | None,
    *,
    dropout: bool,
) -> Choice:
    """The kernel of one call: the platform's, unless a constraint sends it to XLA.

    Args:
      q: [B, T, N, H]; k: [B, S, N, H].
      mask: structured (kernels need one), dense bool[B, T, S], or None.
      dropout: attention dropout is active (it needs the weights).
    """
    choice = platform_choice(setting)
    if not choice.fused:
        return choice
    problem = _constraint(choice.kernel, q, k, mask, dropout)
    if problem is None:
        return choice
    return Choice("vmap", f"XLA instead of {choice.kernel}: {problem}")


def _constraint(kernel, q, k, mask, dropout) -> str | None:
    """Why `kernel` cannot run this call, or None."""
    if dropout:
        return "attention dropout needs the weights"
    if not isinstance(mask, AttentionMask):
        return "the mask is dense (no structure to pass)"
    t, s, h = q.shape[1], k.shape[1], q.shape[3]
    if kernel == "cudnn":
        if q.dtype not in (jnp.bfloat16, jnp.float16):
            return f"cuDNN flash attention needs bf16/fp16 operands, not {q.dtype.name}"
        if h % 8 or h > CUDNN_MAX_HEAD_DIM:
            return f"head size {h} (cuDNN: a multiple of 8, at most {CUDNN_MAX_HEAD_DIM})"
        if mask.window and not mask.causal:
            return "cuDNN windows are causal only (an encoder window)"
        if mask.packed and (t % 2 or s % 2):
            return f"packed rows need even lengths with cuDNN's mask input (T={t}, S={s})"
        return None
    if t % SPLASH_BLOCK or s % SPLASH_BLOCK:
        return f"lengths T={t}, S={s} are not multiples of {SPLASH_BLOCK} (splash blocks)"
    return None


_REPORTED: set[str] = set()  # lines already printed by this process (one per path)


def report(choice: Choice, where: str) -> None:
    """Prints `attention (<where>): <kernel> (<why>)` once per distinct line."""
    names = {"cudnn": "cuDNN flash attention", "splash": "Pallas splash attention"}
    line = f"attention ({where}): {names.get(choice.kernel, 'XLA')} ({choice.why})"
    if line not in _REPORTED:
        _REPORTED.add(line)
        print(line, file=sys.stderr, flush=True)


def run(choice: Choice, q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask):
    """The fused kernel's output [B, T, N, H] for q [B, T, N, H], k/v [B, S, N, H]."""
    if choice.kernel == "cudnn":
        return cudnn_attention(q, k, v, mask)
    return splash_attention(q, k, v, mask, interpret=_interpret())


def cudnn_attention(q, k, v, mask: AttentionMask) -> jax.Array:
    """cuDNN flash attention: causal flag, key lengths and a causal window instead of a
    mask; packed rows as a mask (cuDNN adds it as a bias inside the kernel)."""
    if mask.packed:
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask.dense()[:, None], is_causal=mask.causal, implementation="cudnn"
        )
    lengths = jnp.sum(mask.key_valid, axis=-1, dtype=jnp.int32)  # [B]: right padding
    self_attention = mask.query_len == mask.key_valid.shape[1] and mask.causal
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=mask.causal,
        query_seq_lengths=lengths if self_attention else None,
        key_value_seq_lengths=lengths,
        local_window_size=(mask.window, 0) if mask.window else None,
        implementation="cudnn",
    )


def splash_attention(q, k, v, mask: AttentionMask, *, interpret: bool = False) -> jax.Array:
    """Pallas splash attention, vmapped over examples: a static causal/local pattern per
    head, and segment ids for padding (0 = padding) and packed rows. Under a mesh
    (`jax.set_mesh`; the train step and the searches trace under theirs) the kernel runs
    in `shard_map` on each device's rows and heads."""
    b, t, n, h = q.shape
    if mask.packed:
        q_seg, kv_seg = mask.query_segments, mask.key_segments
    else:  # every query is example 1; padded keys are segment 0, which no query attends
        q_seg = jnp.ones((b, t), jnp.int32)
        kv_seg = mask.key_valid.astype(jnp.int32)
    q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
    split = _mesh_split(b, n)
    if split is None:
        return _splash_local(q, k, v, q_seg, kv_seg, mask, interpret)
    # XLA cannot partition a Mosaic (Pallas TPU) call at all ("wrap the call in a
    # shard_map"): every mesh axis is manual here, each device runs the kernel on its own
    # rows (and heads, with model > 1), replicated along the other axes.
    mesh, rows, heads = split
    qkv = jax.sharding.PartitionSpec(rows, None, heads, None)
    seg = jax.sharding.PartitionSpec(rows, None)
    return jax.shard_map(
        lambda q, k, v, qs, ks: _splash_local(q, k, v, qs, ks, mask, interpret),
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, seg, seg),
        out_specs=qkv,
        check_vma=False,  # the splash library declares its outputs without mesh axes
    )(q, k, v, q_seg, kv_seg)


def _mesh_split(batch: int, heads: int):
    """(mesh, batch axes, head axis or None) of the mesh in context (`jax.set_mesh`), where
    its batch axes divide the batch; None without such a mesh."""
    from flaxformer_lite.parallel.partitioning import BATCH_AXES, MODEL_AXIS

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if rows and batch % math.prod(mesh.shape[a] for a in rows):
        rows = ()
    model = mesh.shape.get(MODEL_AXIS, 1) if MODEL_AXIS in mesh.axis_names else 1
    head_axis = MODEL_AXIS if model > 1 and heads % model == 0 else None
    if not rows and head_axis is None:
        return None
    return mesh, rows, head_axis


def _splash_local(q, k, v, q_seg, kv_seg, mask: AttentionMask, interpret: bool):
    """The kernel on the arrays as given (one device's rows and heads)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )

    b, t, n, h = q.shape
    s = k.shape[1]
    kernel = splash.make_splash_mha(
        _splash_mask(mask, n, t, s),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=_splash_blocks(t, s),
        interpret=interpret,
    )
    segments = splash.SegmentIds(q=q_seg, kv=kv_seg)
    scale = jnp.asarray(1.0 / math.sqrt(h), q.dtype)  # splash does not scale the scores
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, L, N, H] -> [B, N, L, H]
    out = jax.vmap(kernel)(heads_first(q * scale), heads_first(k), heads_first(v), segments)
    return out.transpose(0, 2, 1, 3)  # [B, T, N, H]


def _splash_mask(mask: AttentionMask, heads: int, t: int, s: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if mask.window:
        right = 0 if mask.causal else mask.window
        base = sm.LocalMask((t, s), window_size=(mask.window, right), offset=0)
    elif mask.causal:
        base = sm.CausalMask((t, s))
    else:
        base = sm.FullMask((t, s))
    return sm.MultiHeadMask([base] * heads)


def _splash_blocks(t: int, s: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )

    bq = math.gcd(t, 512)  # the largest of 128 / 256 / 512 that divides the length
    bk = math.gcd(s, 512)
    return splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
