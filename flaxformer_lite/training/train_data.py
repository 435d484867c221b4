"""Training input: vocabularies, the batch sequence, and the data iterator's state.

Batches are random access (`batches[i]` is batch i, a pure function of the
seed and i), so the iterator's state is one index; `checkpoint_meta` stores it
with what decides the batch sequence, and `first_batch` reads it back on
resume. `prefetch` builds the next batches on a host thread while the device
runs the step, and `device_prefetch` sends the next one to the devices.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from flaxformer_lite import datasets
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.sections import DataConfig, TrainConfig
from flaxformer_lite.data import batching
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.examples import texts


def prefetch(make: Callable[[int], dict], start: int, stop: int, size: int = 2) -> Iterator:
    """Yields make(i) for i in [start, stop), computed one or two batches ahead in a thread."""
    q: queue.Queue = queue.Queue(maxsize=size)

    def worker():
        try:
            for i in range(start, stop):
                q.put(make(i))
        except BaseException as e:  # surfaced in the consumer, never swallowed
            q.put(e)

    threading.Thread(target=worker, daemon=True).start()
    for _ in range(start, stop):
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        yield item


def device_prefetch(batches: Iterator, put: Callable[[dict], dict], size: int = 2) -> Iterator:
    """Yields put(batch) for each of `batches`, having called `put` on up to `size - 1` later
    batches already: `jax.device_put` returns before the copy ends, so the next batch travels
    to the devices while the current step runs."""
    ahead: collections.deque = collections.deque()
    for batch in batches:
        ahead.append(put(batch))
        if len(ahead) == size:
            yield ahead.popleft()
    yield from ahead


def make_train_batches(
    data: DataConfig, train: TrainConfig, train_split, tokenizer, log, *, extended: bool = False
):
    """Random-access training batches: `batches[step]` is the batch of that step.

    data.batching: "fixed" (every batch at the maximum lengths), "bucket" (a few
    length buckets; data.max_tokens > 0 sizes each bucket's rows by a token
    budget) or "pack" (several examples per row, with segment ids). Each
    process reads only its own rows. `extended`: the copy head's extended ids
    (data/extended_ids.py).
    """
    t, d = train, data
    mode = d.batching
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    tokenized = batching.tokenize_split(
        train_split,
        tokenizer,
        max_source_len=d.max_source_len,
        max_target_len=d.max_target_len,
        extended=extended,
    )
    log(
        f"train: {len(tokenized.sources)} examples, {tokenized.num_sources_truncated} sources "
        f"and {tokenized.num_targets_truncated} targets truncated to "
        f"{d.max_source_len}/{d.max_target_len} "
        + ("frames/tokens" if tokenized.source_features else "tokens")
    )
    if mode == "fixed":
        plan = batching.FixedBatches(tokenized, batch_size=t.batch_size, seed=t.seed, **shard)
    elif mode == "bucket":
        max_tokens = d.max_tokens or None
        plan = batching.BucketedBatches(
            tokenized,
            batch_size=None if max_tokens else t.batch_size,
            max_tokens=max_tokens,
            seed=t.seed,
            pad_to_multiple=jax.local_device_count(),  # every device gets the same rows
            **shard,
        )
    else:
        plan = batching.PackedBatches(
            tokenized,
            rows=t.batch_size,
            source_len=d.max_source_len,
            target_len=d.max_target_len,
            seed=t.seed,
            **shard,
        )
    log(
        f"train batches: {mode}, shapes {sorted(plan.shapes())}, "
        f"padding {plan.padding_fraction(min(len(plan), 200)):.1%}"
    )
    return plan


def load_or_train_tokenizer(data: DataConfig, workdir: str, train_split):
    """(the workdir's vocabularies if it has them, else ones trained on the training split,
    whether they are new)."""
    if tokenizer_lib.Vocabularies.exists(workdir):
        vocab = tokenizer_lib.Vocabularies.load(workdir)
        if vocab.shared != data.shared_vocab:
            raise ConfigError(
                f"data.shared_vocab={data.shared_vocab} but workdir {workdir} "
                f"holds {'one shared vocabulary' if vocab.shared else 'separate vocabularies'}; "
                "use the run's setting or a new --workdir"
            )
        return vocab, False
    d = data
    targets = texts(train_split, "target")
    # A speech source is frames: its text is a description, and the vocabulary (both sides'
    # when not shared; the source one is then never read) comes from the transcripts alone.
    features = datasets.has_features(d)
    vocab = tokenizer_lib.Vocabularies.train(
        (targets if not d.shared_vocab else []) if features else texts(train_split, "source"),
        targets,
        d.vocab_size,
        d.vocab_model_type,
        shared=d.shared_vocab,
        target_vocab_size=d.target_vocab_size or None,
    )
    return vocab, True


def data_identity(data: DataConfig, train: TrainConfig, train_split) -> dict[str, Any]:
    """What decides the sequence of training batches (batch i is a function of these and i)."""
    t, d = train, data
    mode = d.batching
    return {
        "train_examples": len(train_split),
        "batching": mode,
        "batch_size": t.batch_size,
        "max_tokens": d.max_tokens if mode == "bucket" else 0,
        "max_source_len": d.max_source_len,
        "max_target_len": d.max_target_len,
        "seed": t.seed,
    }


def checkpoint_meta(saved: dict, data_id: dict, next_batch: int) -> dict[str, Any]:
    """The JSON item stored with each checkpoint: run config and the data iterator's state."""
    return {"run_config": saved, "data": {"next_batch": next_batch, "identity": data_id}}


def first_batch(saved_data: dict | None, data_id: dict, step: int, log) -> int:
    """The index of the batch to train on next, from the restored iterator state.

    Batches are random access, so the iterator state is one index; it is the
    step of the checkpoint unless that run read batches at an offset. When what
    decides the batches changed since the checkpoint, the run goes on (e.g. a
    fine-tuning on new data) with a warning: it no longer sees the examples an
    uninterrupted run would have seen.
    """
    if saved_data is None:  # a fresh run, or a checkpoint from before iterator states
        return step
    before = saved_data.get("identity", {})
    changed = [f"{k}: {before.get(k)!r} -> {v!r}" for k, v in data_id.items() if before.get(k) != v]
    if changed:
        log(
            "warning: the training data changed since the checkpoint ("
            + "; ".join(changed)
            + "); batches from here on differ from those of an uninterrupted run"
        )
    return int(saved_data["next_batch"])
