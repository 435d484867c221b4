"""The programs the lowering report exports: every program a user runs, on abstract arguments.

Each `Program` builds (function, abstract arguments, mesh -> their shardings) for a small
model in the accelerator policy, so `lowering.py` exports it for a platform and
`lowering.traffic` compiles it on a simulated mesh without allocating parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxformer_lite.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Program:
    """A function and the abstract arguments it is exported with."""

    name: str
    describe: str
    # -> (function, abstract args, mesh -> the args' shardings by the library's rules)
    build: Callable[[], tuple[Callable, tuple, Callable]]


B, S, T = 8, 256, 256  # lengths that tile in 128-row splash blocks
VOCAB = 512


def small_config(**overrides) -> TransformerConfig:
    """A small model in the accelerator policy: bf16 compute, float32 parameters; head
    size 128 (both fused kernels take it)."""
    base = dict(
        vocab_size=VOCAB,
        d_model=256,
        num_heads=2,
        d_ff=512,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.1,
        max_len=512,
        dtype=jnp.bfloat16,
    )
    return TransformerConfig(**(base | overrides))


def _abstract(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _batch(packed: bool = False, features: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    i32 = jnp.int32
    inputs = (B, S, features) if features else (B, S)
    batch = {
        "inputs": jax.ShapeDtypeStruct(inputs, jnp.float32 if features else i32),
        "targets": jax.ShapeDtypeStruct((B, T), i32),
    }
    if packed:
        for side, n in (("inputs", S), ("targets", T)):
            batch[f"{side}_segments"] = jax.ShapeDtypeStruct((B, n), i32)
            batch[f"{side}_positions"] = jax.ShapeDtypeStruct((B, n), i32)
    return batch


def _train(model, *, packed=False, grad_accum_steps=1):
    from flaxformer_lite.training import state as state_lib
    from flaxformer_lite.training.step import train_step

    def build():
        tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
        boxed = state_lib.abstract_state(model, tx, 0, S, T)
        abstract = jax.tree.map(_abstract, _unbox(boxed))
        fn = functools.partial(train_step, model=model, tx=tx, grad_accum_steps=grad_accum_steps)
        return fn, (abstract, _batch(packed)), _shardings(boxed, _batch(packed))

    return build


def _unbox(tree):
    import flax.linen as nn

    return nn.meta.unbox(tree)


def _boxed_params(model):
    from flaxformer_lite.training import state as state_lib

    shapes = state_lib.init_shapes(model, S, T)
    return jax.eval_shape(lambda rng: model.init(rng, shapes), jax.random.PRNGKey(0))


def _params(model):
    return jax.tree.map(_abstract, _unbox(_boxed_params(model)))


def _shardings(boxed, batch):
    """mesh -> (shardings of the boxed tree by the logical rules, the batch's sharding)."""

    def on(mesh):
        from flaxformer_lite.parallel import partitioning

        rows = partitioning.batch_sharding(mesh)
        return (
            partitioning.logical_shardings(boxed, mesh),
            {k: rows for k in batch},
        )

    return on


def _autoregressive(**overrides):
    from flaxformer_lite.models.autoregressive import AutoregressiveModel

    return AutoregressiveModel(small_config(**overrides), label_smoothing=0.1)


def _copy_model():
    from flaxformer_lite.config.variants import CopyHead
    from flaxformer_lite.models.autoregressive import AutoregressiveModel

    return AutoregressiveModel(
        small_config(), label_smoothing=0.1, copy=CopyHead(layer=-1, heads=(0,))
    )


def _nat_model():
    from flaxformer_lite.models.non_autoregressive import NonAutoregressiveModel

    return NonAutoregressiveModel(small_config(), label_smoothing=0.1)


def _ctc_model():
    from flaxformer_lite.models.ctc_nat import CTCModel

    return CTCModel(small_config(max_len=1024), upsample_ratio=2.0)


def _search(model_fn, search_fn):
    def build():
        model = model_fn()
        boxed = _boxed_params(model)
        batch = {"inputs": jax.ShapeDtypeStruct((B, S), jnp.int32)}
        fn = functools.partial(_predict, model=model, search=search_fn())
        return fn, (jax.tree.map(_abstract, _unbox(boxed)), batch), _shardings(boxed, batch)

    return build


def _predict(params, batch, *, model, search):
    return model.predict(params, batch, search, jax.random.PRNGKey(0))


def _score():
    model = _autoregressive()
    boxed = _boxed_params(model)
    args = (jax.tree.map(_abstract, _unbox(boxed)), _batch())
    return functools.partial(_score_fn, model=model), args, _shardings(boxed, _batch())


def _score_fn(params, batch, *, model):
    return model.score(params, batch)


def _greedy():
    from flaxformer_lite.models.predict import SearchConfig

    return SearchConfig("greedy", max_len=64)


def _beam():
    from flaxformer_lite.models.predict import SearchConfig

    return SearchConfig("beam", max_len=64, beam_size=4)


def _nat_search():
    from flaxformer_lite.models.non_autoregressive import NATSearch

    return NATSearch(max_len=T, iterations=4, length_beam=2)


def _ctc_search():
    from flaxformer_lite.models.non_autoregressive import NATSearch

    return NATSearch(max_len=T)  # CTC decoding reads max_len only: one pass


SLOTS, BEAMS, STEPS_PER_SYNC = 8, 4, 4  # a serving pool: 8 sentences of 4 beams


def _engine(program: str):
    """The server's two device programs (`serving/slots.py`) for a beam pool: `admit`
    (encode M newcomers, write them into free slots) and `run` (STEPS_PER_SYNC decoding steps
    of every slot). Sharded lowering is not defined for them: the engine is single-device."""

    def build():
        from flaxformer_lite.constants import BOS_ID, EOS_ID
        from flaxformer_lite.serving import slots

        model = _autoregressive().module
        params = jax.tree.map(_abstract, _unbox(_boxed_params(_autoregressive())))
        state = jax.eval_shape(lambda: slots.empty(model, SLOTS, BEAMS, S, T))
        if program == "run":
            fn = functools.partial(slots.run, model, steps=STEPS_PER_SYNC, eos_id=EOS_ID)
            return fn, (params, state), None
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        m = SLOTS // 2
        new = slots.Requests(
            slot=i32(m),
            inputs=i32(m, S),
            max_len=i32(m),
            min_len=i32(m),
            width=i32(m),
            alpha=jax.ShapeDtypeStruct((m,), jnp.float32),
        )
        return functools.partial(slots.admit, model, bos_id=BOS_ID), (params, state, new), None

    return build


def _scan_remat_model():
    return _autoregressive(scan_layers=True, remat="dots_with_no_batch_dims_saveable")


PROGRAMS: dict[str, Program] = {
    p.name: p
    for p in (
        Program("train_full", "train step, full attention", _train(_autoregressive())),
        Program(
            "train_local",
            "train step, local attention (windows 32)",
            _train(_autoregressive(encoder_window=32, decoder_window=32)),
        ),
        Program("train_packed", "train step, packed rows", _train(_autoregressive(), packed=True)),
        Program("train_scan_remat", "train step, scanned layers + remat", lambda: None),
        Program(
            "train_grad_accum",
            "train step, 2 accumulated micro-batches",
            _train(_autoregressive(), grad_accum_steps=2),
        ),
        Program("train_copy", "train step, copy head", lambda: None),
        Program("train_nat", "train step, NAT (CMLM + length)", lambda: None),
        Program("train_ctc", "train step, CTC + glancing (2x upsampled)", lambda: None),
        Program("ctc_decode", "CTC one pass (argmax, collapse)", lambda: None),
        Program("greedy", "greedy search, KV cache", _search(_autoregressive, _greedy)),
        Program("beam", "beam search (4), KV cache", _search(_autoregressive, _beam)),
        Program("nat_decode", "Mask-Predict (4 iterations, 2 lengths)", lambda: None),
        Program("score", "forced scoring", _score),
        Program("engine_admit", "server: encode newcomers into free slots", _engine("admit")),
        Program(
            "engine_run",
            f"server: {STEPS_PER_SYNC} steps of {SLOTS} slots x {BEAMS} beams",
            _engine("run"),
        ),
    )
}


def _lazy_train(model_fn, **kw):
    return lambda: _train(model_fn(), **kw)()


PROGRAMS["train_scan_remat"] = dataclasses.replace(
    PROGRAMS["train_scan_remat"], build=_lazy_train(_scan_remat_model)
)
PROGRAMS["train_copy"] = dataclasses.replace(PROGRAMS["train_copy"], build=_lazy_train(_copy_model))
PROGRAMS["train_ctc"] = dataclasses.replace(PROGRAMS["train_ctc"], build=_lazy_train(_ctc_model))
PROGRAMS["ctc_decode"] = dataclasses.replace(
    PROGRAMS["ctc_decode"], build=_search(_ctc_model, _ctc_search)
)
PROGRAMS["train_nat"] = dataclasses.replace(PROGRAMS["train_nat"], build=_lazy_train(_nat_model))
PROGRAMS["nat_decode"] = dataclasses.replace(
    PROGRAMS["nat_decode"], build=_search(_nat_model, _nat_search)
)
