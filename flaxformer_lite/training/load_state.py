"""Loading a training workdir whole: model, train state, vocabularies and run config.

For resuming and for tests that compare states; decoding reads parameters only
(`training/restore.py`).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.models.from_config import build_model
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import checkpoints, optim, restore
from flaxformer_lite.training.state import ParamShapes, abstract_state, param_shapes
from flaxformer_lite.training.workdir import load_run_config


def restore_trained(workdir: str, step: int | None = None, average: int = 1):
    """Loads a training workdir whole: (model, train state, vocabularies, `RunConfig`).

    For resuming and for tests that compare states; decoding reads parameters
    only (`restore.restore_params`).

    Args:
      step: the checkpoint to load (default: the latest).
      average: > 1: the state of `step` with its parameters replaced by the
        mean parameters of the last `average` checkpoints up to `step`.
    Raises:
      WorkdirError: not a training workdir.
      FileNotFoundError: it has no (complete) checkpoint, or fewer than `average`.
    """
    saved = load_run_config(workdir)
    model = build_model(saved)
    _, tx = optim.of_run(saved)
    tokenizer = tokenizer_lib.Vocabularies.load(workdir)
    mesh = partitioning.make_mesh()
    d = saved.data
    abstract = abstract_state(model, tx, saved.train.seed, d.max_source_len, d.max_target_len)
    shardings = partitioning.logical_shardings(abstract, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.meta.unbox(abstract),
        shardings,
    )
    ckpt = checkpoints.Checkpointer(workdir, keep=1 << 30, save_every=0)
    try:
        state, _ = ckpt.restore(target, step)
    finally:
        ckpt.close()
    if average > 1:
        params, _ = restore.restore_params(workdir, int(state.step), average)
        state = state.replace(params=params)
    return model, state, tokenizer, saved


def saved_param_shapes(saved: RunConfig) -> ParamShapes:
    """`state.param_shapes` of the model of a run config as a workdir saved it."""
    return param_shapes(build_model(saved))
