"""Training: train state, jitted train/eval steps, and the `train_and_evaluate` loop.

The step functions are pure and jit-compiled once per shape; the loop does no
per-token Python work. Everything runs on a device mesh from the start (one
device on a laptop), with shardings derived from the parameters' logical axis
names in `partitioning.py`.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from tqdm import tqdm

from flaxformer_lite import run_config as run_config_lib
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.pipeline import make_dataset, texts
from flaxformer_lite.models import predict
from flaxformer_lite.models.transformer import Transformer, shift_right
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import checkpoints, optim, train_data
from flaxformer_lite.training.metric_writer import MetricWriter


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs. Pytree of arrays only (the optimiser is static)."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any  # model parameters
    opt_state: Any  # optimiser moments
    rng: jax.Array  # uint32[2] base key for dropout; step keys are folded in


# ----------------------------------------------------------------------------
# State creation.
# ----------------------------------------------------------------------------


def _init_fn(
    model: Transformer,
    tx: optax.GradientTransformation,
    seed: int,
    source_len: int,
    target_len: int,
) -> Callable[[], TrainState]:
    def init() -> TrainState:
        params_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
        dummy_src = jnp.ones((1, source_len), jnp.int32)
        dummy_tgt = jnp.ones((1, target_len), jnp.int32)
        params = model.init({"params": params_rng}, dummy_src, dummy_tgt)["params"]
        return TrainState(jnp.int32(0), params, tx.init(params), dropout_rng)

    return init


def abstract_state(model, tx, seed, source_len, target_len):
    """Shapes of the train state, with logical-axis boxes, without allocating."""
    return jax.eval_shape(_init_fn(model, tx, seed, source_len, target_len))


def create_state(model, tx, mesh, *, seed: int, source_len: int, target_len: int):
    """Initialises the state directly into its shardings. Returns (state, shardings)."""
    init = _init_fn(model, tx, seed, source_len, target_len)
    shardings = partitioning.logical_shardings(jax.eval_shape(init), mesh)
    state = jax.jit(lambda: nn.meta.unbox(init()), out_shardings=shardings)()
    return state, shardings


# ----------------------------------------------------------------------------
# Steps.
# ----------------------------------------------------------------------------


def _loss_sums(params, batch, *, model, label_smoothing, bos_id, rng):
    """Summed (not averaged) loss of one (micro-)batch and its metric sums."""
    packing = {k: batch[k] for k in PACKING_KEYS} if PACKING_KEYS[0] in batch else None
    segments = None if packing is None else packing["targets_segments"]
    decoder_inputs = shift_right(batch["targets"], bos_id, segments)  # BOS + targets[:-1]
    logits = model.apply(
        {"params": params},
        batch["inputs"],
        decoder_inputs,
        deterministic=False,
        rngs={"dropout": rng},
        packing=packing,
    )  # [B, T, V]
    sums = cross_entropy.metrics_sums(logits, batch["targets"], label_smoothing, segments)
    return sums["loss"], sums


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    model: Transformer,
    tx: optax.GradientTransformation,
    label_smoothing: float,
    bos_id: int,
    grad_accum_steps: int = 1,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One teacher-forced update.

    The gradient is that of the per-token mean loss over the whole batch. With
    `grad_accum_steps` > 1 the batch is split into that many micro-batches run
    one after another by `lax.scan` (activation memory of one micro-batch); the
    summed gradients are divided by the batch's token count once, so the update
    equals the one-batch update.

    Args:
      batch: "inputs" int32[B, S]; "targets" int32[B, T] (ids + EOS, PAD after);
        for packed rows also the segment and position fields of `PACKING_KEYS`.
        B must be divisible by `grad_accum_steps`.
    Returns:
      (new state, metric sums as float32 scalars; see `cross_entropy.metrics_sums`).
    """
    rng = jax.random.fold_in(state.rng, state.step)
    grad_fn = jax.grad(
        functools.partial(_loss_sums, model=model, label_smoothing=label_smoothing, bos_id=bos_id),
        has_aux=True,
    )
    if grad_accum_steps == 1:
        grads, sums = grad_fn(state.params, batch, rng=rng)
    else:
        n = grad_accum_steps
        micro = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

        def accumulate(carry, inputs):
            i, mb = inputs
            g, s = grad_fn(state.params, mb, rng=jax.random.fold_in(rng, i))
            return jax.tree.map(jnp.add, carry, (g, s)), None

        zeros = jax.eval_shape(
            lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro), rng=rng)
        )
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zeros)
        (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(n), micro))
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    sums["grad_norm"] = optax.global_norm(grads)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), sums


def jit_train_step(
    model: Transformer,
    tx: optax.GradientTransformation,
    mesh,
    state_shardings,
    *,
    label_smoothing: float,
    bos_id: int,
    grad_accum_steps: int = 1,
):
    """`train_step` jitted on `mesh`: (state, batch) -> (new state, replicated metric sums).

    On accelerators the old state is donated, so parameters and optimiser
    moments are updated in place (one copy of the state in device memory).
    On CPU it is not. Without `host_memory`'s reuse of freed memory,
    donation gave no faster step (XLA:CPU copies each weight that is still
    read after its update) and more page faults (209k against 128k per base
    model step). With it, the median step was 1.7% faster, but the heap
    fragmented: over 50 steps the process grew from 2.0 to 5.2 GB, with
    steps that mapped 800 MB anew (up to 3 s), where without donation it
    held 3.1 GB from step 12 on with no page faults.
    """
    donate = () if mesh.devices.flat[0].platform == "cpu" else (0,)
    return jax.jit(
        functools.partial(
            train_step,
            model=model,
            tx=tx,
            label_smoothing=label_smoothing,
            bos_id=bos_id,
            grad_accum_steps=grad_accum_steps,
        ),
        in_shardings=(state_shardings, partitioning.batch_sharding(mesh)),
        out_shardings=(state_shardings, partitioning.replicated(mesh)),
        donate_argnums=donate,
    )


def eval_step(
    params, batch, *, model: Transformer, label_smoothing: float, bos_id: int
) -> dict[str, jax.Array]:
    """Teacher-forced metric sums on one batch (padding rows contribute nothing)."""
    logits = model.apply({"params": params}, batch["inputs"], shift_right(batch["targets"], bos_id))
    return cross_entropy.metrics_sums(logits, batch["targets"], label_smoothing)


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


PACKING_KEYS = ("inputs_segments", "inputs_positions", "targets_segments", "targets_positions")


def _device_batch(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """The model's inputs of this process's rows of a batch, as global arrays on the mesh
    (packing fields when present)."""
    keys = ("inputs", "targets") + tuple(k for k in PACKING_KEYS if k in batch)
    return partitioning.put_batch({k: batch[k] for k in keys}, mesh)


def evaluate(
    params,
    dataset,
    references: list[str],
    tokenizer,
    mesh,
    *,
    eval_fn,
    decode_fn,
    max_batches: int | None = None,
    bleu: bool = False,
) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """Teacher-forced metrics, and free-running decoding scored against the references.

    Every process reads the same global batches and feeds its own rows of them;
    the metric sums (replicated by `eval_fn`) and the hypotheses (gathered here)
    reach every process, so all of them compute the same metrics.

    Args:
      dataset: fixed-shape global batches of the split in order (not shuffled).
      references: the split's raw target strings, in the same order.
      decode_fn: (params, inputs int32[B, S]) -> int32[B, T] best hypotheses.
      bleu: also compute sacreBLEU and chrF (corpus level).
    Returns:
      (metrics, [(prediction, reference)] for every evaluated example).
    """
    target_vocab = tokenizer_lib.Vocabularies.of(tokenizer).target
    n = len(dataset) if max_batches is None else min(len(dataset), max_batches)
    totals: dict[str, float] = {}
    hyps: list[str] = []
    for i in range(n):
        host = dataset[i]
        rows = partitioning.process_rows(len(host["valid"]), mesh)
        batch = _device_batch({k: v[rows] for k, v in host.items()}, mesh)
        for k, v in jax.device_get(eval_fn(params, batch)).items():
            totals[k] = totals.get(k, 0.0) + float(v)
        # [B, T]; a plain host copy with one process, an all-gather across processes.
        predicted = multihost_utils.process_allgather(
            decode_fn(params, batch["inputs"]), tiled=True
        )
        hyps.extend(target_vocab.decode_batch(predicted[host["valid"]]))
    refs = references[: len(hyps)]
    metrics = cross_entropy.summarize(totals)
    metrics["exact_match"] = sum(h == r for h, r in zip(hyps, refs)) / max(len(refs), 1)
    if bleu:
        import sacrebleu

        metrics["bleu"] = sacrebleu.corpus_bleu(hyps, [refs]).score
        metrics["chrf"] = sacrebleu.corpus_chrf(hyps, [refs]).score
    return metrics, list(zip(hyps, refs))


def bleu_signature(pairs: list[tuple[str, str]]) -> str:
    """The sacreBLEU signature of the BLEU `evaluate` reports for these (hyp, ref) pairs."""
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    metric.corpus_score([h for h, _ in pairs], [[r for _, r in pairs]])
    return str(metric.get_signature())


def make_optimizer(config: ml_collections.ConfigDict, model_cfg):
    """(schedule, optimiser) of a run config."""
    o = config.optim
    schedule = optim.make_schedule(
        o.schedule,
        d_model=model_cfg.d_model,
        warmup_steps=o.warmup_steps,
        learning_rate=o.learning_rate,
        total_steps=config.train.num_steps,
    )
    tx = optim.make_optimizer(
        schedule,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip_norm=o.grad_clip_norm,
    )
    return schedule, tx


def restore_trained(workdir: str, step: int | None = None, average: int = 1):
    """Loads a training workdir: (model, state, vocabularies, run config dict).

    Args:
      step: the checkpoint to load (default: the latest).
      average: > 1: the state of `step` with its parameters replaced by the
        mean parameters of the last `average` checkpoints up to `step`
        (checkpoint averaging, as fairseq's average_checkpoints.py; it
        usually adds a little BLEU at no training cost).
    Raises:
      WorkdirError: not a training workdir.
      FileNotFoundError: it has no (complete) checkpoint, or fewer than `average`.
    """
    saved = checkpoints.load_run_config(workdir)
    config = ml_collections.ConfigDict(saved)
    model_cfg = run_config_lib.model_config(config)
    model = Transformer(model_cfg)
    _, tx = make_optimizer(config, model_cfg)
    tokenizer = tokenizer_lib.Vocabularies.load(workdir)
    mesh = partitioning.make_mesh()
    d = config.data
    abstract = abstract_state(model, tx, config.train.seed, d.max_source_len, d.max_target_len)
    shardings = partitioning.logical_shardings(abstract, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.meta.unbox(abstract),
        shardings,
    )
    ckpt = checkpoints.Checkpointer(workdir, keep=1 << 30, save_every=0)
    try:
        state, _ = ckpt.restore(target, step)
        if average > 1:
            state = state.replace(params=_average_params(ckpt, target, state, average))
    finally:
        ckpt.close()
    return model, state, tokenizer, saved


def _average_params(ckpt: checkpoints.Checkpointer, target, last, count: int):
    """Mean parameters of the last `count` checkpoints up to the restored state `last`
    (float32 sums); `last` itself is not read again."""
    step = int(last.step)
    steps = [s for s in ckpt.all_steps() if s <= step][-count:]
    if len(steps) < count:
        raise FileNotFoundError(
            f"averaging {count} checkpoints needs {count} up to step {step}, but "
            f"{ckpt.directory} has {len(steps)}: {', '.join(map(str, steps))}"
        )
    earlier = (ckpt.restore(target, s)[0].params for s in steps[:-1])  # steps[-1] is `last`
    total = None
    for params in itertools.chain(earlier, [last.params]):  # in step order, one at a time
        params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
    return jax.tree.map(lambda t, x: (t / count).astype(x.dtype), total, last.params)


def _print_examples(dataset, tokenizer, pairs, count: int, log) -> None:
    """Logs the first `count` held-out examples and up to `count` of the errors."""
    source_vocab = tokenizer_lib.Vocabularies.of(tokenizer).source
    sources = []
    for i in range(len(dataset)):
        batch = dataset[i]
        sources.extend(source_vocab.decode_batch(batch["inputs"][batch["valid"]]))
    rows = list(zip(sources, pairs))
    errors = [r for r in rows[count:] if r[1][0] != r[1][1]]  # beyond the rows shown first
    wrong = sum(hyp != ref for _, (hyp, ref) in rows)
    log(f"held-out test examples ({wrong} of {len(rows)} wrong), source => prediction:")
    for src, (hyp, ref) in rows[:count] + errors[:count]:
        log(
            f"  {'ok ' if hyp == ref else 'ERR'} {src} => {hyp}"
            + ("" if hyp == ref else f"  (expected: {ref})")
        )


def _prepare_workdir(config: ml_collections.ConfigDict, workdir: str):
    """Data splits, tokenizer, model config, saved run config, and whether the workdir had a run.

    Process 0 prepares the data, trains the vocabulary and claims the workdir;
    the others then read its vocabulary (see `partitioning.process_0_first`).
    """
    splits = run_config_lib.load_splits(config.data)
    if jax.process_index() != 0 and not tokenizer_lib.Vocabularies.exists(workdir):
        raise checkpoints.WorkdirError(
            f"process {jax.process_index()} cannot see the vocabulary in {workdir}, which "
            "process 0 wrote: the workdir must be on a filesystem that every host shares"
        )
    tokenizer, new_vocab = train_data.load_or_train_tokenizer(config, workdir, splits["train"])
    model_cfg = run_config_lib.model_config(
        config,
        tokenizer.source.vocab_size,
        None if tokenizer.shared else tokenizer.target.vocab_size,
    )
    saved = run_config_lib.to_saved_dict(config, model_cfg)
    resumed_dir = checkpoints.claim_workdir(workdir, saved, run_config_lib.SHAPE_FIELDS)
    if new_vocab and jax.process_index() == 0:
        tokenizer.save(workdir)
    return splits, tokenizer, model_cfg, saved, resumed_dir


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, log: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Trains (or resumes) the run in `workdir`, evaluates, and returns final test metrics.

    In a multi-process job every process calls this with the same arguments
    (after `partitioning.initialize_distributed`); each feeds its own rows of
    every batch, all of them save and restore checkpoints together, only
    process 0 logs and writes files, and all return the same metrics.
    """
    # tqdm.write keeps log lines from tearing the progress bar.
    log = log or (lambda s: tqdm.write(s, file=sys.stderr))
    if jax.process_index() != 0:
        log = lambda s: None  # noqa: E731 (one log per job)
    run_config_lib.validate(config)
    t, d = config.train, config.data
    mesh = partitioning.mesh_from_config(config)
    if not (d.get("batching", "fixed") == "bucket" and d.get("max_tokens", 0)):
        partitioning.check_batch_size(t.batch_size, mesh, "train.batch_size")
    partitioning.check_batch_size(t.eval_batch_size, mesh, "train.eval_batch_size")
    splits, tokenizer, model_cfg, saved, resumed_dir = partitioning.process_0_first(
        lambda: _prepare_workdir(config, workdir), "preparing the data and the workdir"
    )

    model = Transformer(model_cfg)
    schedule, tx = make_optimizer(config, model_cfg)
    state, state_shardings = create_state(
        model, tx, mesh, seed=t.seed, source_len=d.max_source_len, target_len=d.max_target_len
    )
    ckpt = checkpoints.Checkpointer(workdir, keep=t.keep_checkpoints, save_every=t.checkpoint_every)
    restored_meta: dict[str, Any] = {}
    if ckpt.latest_step() is not None:
        state, restored_meta = ckpt.restore(state)
        log(f"resumed from step {int(state.step)} in {ckpt.directory}")
    elif resumed_dir:
        log(f"workdir {workdir} has no checkpoint yet; starting at step 0")

    p_train = jit_train_step(
        model,
        tx,
        mesh,
        state_shardings,
        label_smoothing=t.label_smoothing,
        bos_id=tokenizer_lib.BOS_ID,
        grad_accum_steps=t.get("grad_accum_steps", 1),
    )
    # Metric sums come back replicated: every process gets all of them.
    p_eval = jax.jit(
        functools.partial(
            eval_step, model=model, label_smoothing=t.label_smoothing, bos_id=tokenizer_lib.BOS_ID
        ),
        out_shardings=partitioning.replicated(mesh),
    )
    search = predict.SearchConfig(
        t.eval_search, d.max_target_len, beam_size=t.eval_beam_size, alpha=t.eval_alpha
    )

    def p_decode(params, inputs):
        tokens, _ = predict.decode(
            model,
            params,
            inputs,
            search=search,
            bos_id=tokenizer_lib.BOS_ID,
            eos_id=tokenizer_lib.EOS_ID,
        )
        return tokens[:, 0]  # the best hypothesis

    common = dict(
        tokenizer=tokenizer, max_source_len=d.max_source_len, max_target_len=d.max_target_len
    )
    train_ds = train_data.make_train_batches(config, splits["train"], tokenizer, log)
    eval_sets = {
        name: make_dataset(
            splits[name],
            batch_size=t.eval_batch_size,
            seed=0,
            shuffle=False,
            repeat=False,
            drop_remainder=False,
            **common,
        )
        for name in ("validation", "test")
        if name in splits
    }
    references = {name: texts(splits[name], "target") for name in eval_sets}
    writer = MetricWriter(workdir, tensorboard=t.tensorboard)
    start = int(state.step)
    data_id = train_data.data_identity(config, splits["train"])
    first_batch = train_data.first_batch(restored_meta.get("data"), data_id, start, log)

    def run_eval(split: str, step: int, max_batches=None):
        metrics, pairs = evaluate(
            state.params,
            eval_sets[split],
            references[split],
            tokenizer,
            mesh,
            eval_fn=p_eval,
            decode_fn=p_decode,
            max_batches=max_batches,
            bleu=t.eval_bleu,
        )
        writer.write(step, split, metrics)
        log(f"step {step} {split}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics, pairs

    sums_acc: dict[str, jax.Array] | None = None
    t_log, last_logged = time.perf_counter(), start
    bar = tqdm(
        total=t.num_steps,
        initial=start,
        desc="train",
        unit="step",
        disable=not t.progress_bar or jax.process_index() != 0,
        dynamic_ncols=True,
    )
    batches = train_data.prefetch(
        lambda i: train_ds[i], first_batch, first_batch + t.num_steps - start
    )
    for step, host in zip(range(start, t.num_steps), batches):
        state, sums = p_train(state, _device_batch(host, mesh))
        sums_acc = sums if sums_acc is None else jax.tree.map(jnp.add, sums_acc, sums)
        done = step + 1
        if done % t.log_every == 0 or done == t.num_steps:
            fetched = jax.device_get(sums_acc)
            elapsed = time.perf_counter() - t_log
            metrics = cross_entropy.summarize(fetched)
            # grad_norm is summed over the steps since the last record: report the mean.
            metrics["grad_norm"] = float(fetched["grad_norm"]) / (done - last_logged)
            metrics["tokens_per_sec"] = float(fetched["tokens"]) / elapsed
            metrics["learning_rate"] = float(schedule(done - 1))
            writer.write(done, "train", metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_sec']:.0f}")
            sums_acc, t_log, last_logged = None, time.perf_counter(), done
        bar.update(1)
        paused = False
        if t.eval_every and done % t.eval_every == 0 and done != t.num_steps:
            run_eval("validation", done, t.eval_max_batches or None)
            paused = True
        meta = train_data.checkpoint_meta(saved, data_id, first_batch + done - start)
        paused |= ckpt.save(done, state, meta)
        if paused:  # tokens/s measures training alone, not evaluation or checkpointing
            t_log = time.perf_counter()
    bar.close()
    final_step = int(state.step)
    meta = train_data.checkpoint_meta(saved, data_id, first_batch + final_step - start)
    ckpt.save(final_step, state, meta, force=True)
    ckpt.wait()

    results: dict[str, float] = {"step": final_step}
    for split in eval_sets:
        metrics, pairs = run_eval(split, final_step)
        results.update({f"{split}_{k}": v for k, v in metrics.items()})
        if split == "test" and t.num_examples_to_print:
            _print_examples(eval_sets[split], tokenizer, pairs, t.num_examples_to_print, log)
    if t.eval_bleu:
        log(f"BLEU by sacreBLEU, signature {bleu_signature(pairs)}; search: {search}")
    writer.close()
    ckpt.close()
    return results
