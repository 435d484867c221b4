"""The host side of continuous batching: a thread that keeps the device's slots busy.

Sentences (`Job`s) wait in one bounded queue. Between device calls the engine thread moves
waiting sentences into free slots (`slots.admit`, the encoder run for the newcomers only),
runs `steps_per_sync` decoding steps of every slot in one call (`slots.run`), and hands
each sentence that finished its result; with `continuous=False` it admits only into an
empty pool, which is batching whole batches (the baseline it is measured against).

Two pools: greedy requests (width 1) in one with a single beam per slot, beam requests in
one with `beam_size` beams per slot, each request using `width` <= beam_size of them. Every
compiled shape is fixed: the pools' state, and admission in buckets of rows (powers of two
up to the slot count) and source lengths (`translate/bucketing.bucket_lengths`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.serving import slots as slots_lib
from flaxformer_lite.translate.bucketing import bucket_lengths


class Busy(Exception):
    """The queue is full: the caller should retry later (HTTP 503)."""


class Expired(Exception):
    """A sentence passed its deadline before it finished (HTTP 504)."""


@dataclasses.dataclass(eq=False)
class Job:
    """One sentence to translate; `future` gets (tokens list[list[int]], scores list[float]):
    the n-best generated ids (EOS dropped), best first."""

    ids: list[int]  # source ids, EOS last
    width: int = 1  # beams (1: greedy)
    alpha: float = 0.0  # length-penalty exponent (beam search)
    max_len: int = 64
    min_len: int = 0
    nbest: int = 1
    deadline: float = float("inf")  # time.monotonic() past which it is abandoned
    on_tokens: Callable[[list[int]], None] | None = None  # greedy: new ids as they come
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    slot: int = -1
    sent: int = 0  # ids already streamed


class Pool:
    """One compiled pool: N slots of K beams, and which job holds each slot."""

    def __init__(
        self, model, params, *, slots: int, beams: int, source_len: int, max_len: int, steps: int
    ):
        self.model, self.params, self.beams, self.steps = model, params, beams, steps
        self.state = slots_lib.empty(model, slots, beams, source_len, max_len)
        self.jobs: list[Job | None] = [None] * slots
        self._admit = jax.jit(
            functools.partial(slots_lib.admit, model, bos_id=BOS_ID), donate_argnums=1
        )
        self._run = jax.jit(
            functools.partial(slots_lib.run, model, steps=steps, eos_id=EOS_ID), donate_argnums=1
        )
        self._release = jax.jit(lambda s, free: s._replace(done=s.done | free), donate_argnums=0)
        self.buckets = bucket_lengths(source_len)
        self.rows = [1 << i for i in range(slots.bit_length()) if 1 << i < slots] + [slots]

    @property
    def free(self) -> list[int]:
        return [s for s, job in enumerate(self.jobs) if job is None]

    @property
    def busy(self) -> int:
        return sum(job is not None for job in self.jobs)

    def admit(self, jobs: list[Job]) -> None:
        """Writes `jobs` (at most len(free)) into free slots, in row buckets."""
        free = self.free
        while jobs:
            rows = min(r for r in self.rows if r >= min(len(jobs), self.rows[-1]))
            batch, jobs = jobs[:rows], jobs[rows:]
            length = min(b for b in self.buckets if b >= max(len(j.ids) for j in batch))
            slot = np.full((rows,), len(self.jobs), np.int32)  # padding rows: dropped
            inputs = np.full((rows, length), PAD_ID, np.int32)
            fields = np.zeros((4, rows), np.float32)  # max_len, min_len, width, alpha
            for r, job in enumerate(batch):
                job.slot = free.pop(0)
                self.jobs[job.slot] = job
                slot[r] = job.slot
                inputs[r, : len(job.ids)] = job.ids
                fields[:, r] = (job.max_len, job.min_len, job.width, job.alpha)
            ints = fields[:3].astype(np.int32)
            request = slots_lib.Requests(slot, inputs, ints[0], ints[1], ints[2], fields[3])
            self.state = self._admit(self.params, self.state, request)

    def step(self) -> None:
        """Dispatches `steps` steps (asynchronously); `self.view` is read after them."""
        self.state, self.view = self._run(self.params, self.state)

    def release(self, slots: list[int]) -> None:
        """Frees slots whose job was abandoned (the device stops counting them as live)."""
        free = np.zeros((len(self.jobs),), bool)
        free[slots] = True
        self.state = self._release(self.state, free)
        for s in slots:
            self.jobs[s] = None


class Engine:
    """Continuous batching over a greedy pool and a beam pool, on a thread of its own.

    Args:
      model: the `Transformer` module (a plain softmax output); params its parameters.
      slots: sentences decoded at once per pool.
      beam_size: beams per slot of the beam pool (the largest width a request may ask).
      source_len / max_len: the longest source (ids) and output (tokens) a slot holds.
      steps_per_sync: decoding steps per device call; the host checks for finished
        sentences and admits new ones between calls.
      max_queue: sentences waiting at most; `submit` raises `Busy` past it.
      continuous: False admits only into an empty pool (whole-batch batching).
    """

    def __init__(
        self,
        model,
        params,
        *,
        slots: int = 16,
        beam_size: int = 4,
        source_len: int = 64,
        max_len: int = 64,
        steps_per_sync: int = 4,
        max_queue: int = 256,
        continuous: bool = True,
    ):
        model, params = slots_lib.plain_decoder(model, params)
        make = functools.partial(
            Pool,
            model,
            params,
            slots=slots,
            source_len=source_len,
            max_len=max_len,
            steps=steps_per_sync,
        )
        self.pools = {"greedy": make(beams=1)}
        if beam_size > 1:
            self.pools["beam"] = make(beams=beam_size)
        self.beam_size, self.source_len, self.max_len = beam_size, source_len, max_len
        self.max_queue, self.continuous = max_queue, continuous
        self.queue: collections.deque[Job] = collections.deque()
        self.lock = threading.Condition()
        self.stats = collections.Counter()  # tokens, slot_steps, busy_slot_steps, syncs
        self._stopping = False
        self.error: str | None = None  # set when the engine thread failed
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # The caller's side (any thread).

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, jobs: list[Job]) -> None:
        """Queues all of `jobs` or none (raises `Busy` when they do not fit)."""
        for job in jobs:
            if not 1 <= job.width <= self.beam_size or not 0 < len(job.ids) <= self.source_len:
                raise ValueError(f"job outside the engine's limits: {job}")
            if not 0 <= job.min_len < job.max_len <= self.max_len:
                raise ValueError(f"need 0 <= min_len < max_len <= {self.max_len}: {job}")
        with self.lock:
            if self._stopping:
                raise Busy("the server is shutting down")
            if len(self.queue) + len(jobs) > self.max_queue:
                raise Busy(f"{len(self.queue)} sentences are waiting (limit {self.max_queue})")
            self.queue.extend(jobs)
            self.lock.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finishes every queued and running sentence, then ends the thread."""
        with self.lock:
            self._stopping = True
            self.lock.notify()
        self._thread.join(timeout)

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self._thread.ident is not None

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called (new work is refused)."""
        return self._stopping

    def gauges(self) -> dict[str, float]:
        with self.lock:
            queued = len(self.queue)
        return {
            "queue": queued,
            **{f"busy_{name}": pool.busy for name, pool in self.pools.items()},
            **{f"slots_{name}": len(pool.jobs) for name, pool in self.pools.items()},
        }

    # The engine thread.

    def _loop(self) -> None:
        """Runs until stopped and drained; a device error fails every job it holds."""
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 - reported to every waiting caller
            self.error = f"the decoding engine failed: {type(e).__name__}: {e}"
            with self.lock:
                waiting = [*self.queue, *(j for p in self.pools.values() for j in p.jobs if j)]
                self.queue.clear()
                self._stopping = True
            for job in waiting:
                if not job.future.done():
                    job.future.set_exception(RuntimeError(self.error))

    def _serve(self) -> None:
        while True:
            with self.lock:
                idle = not self.queue and not any(p.busy for p in self.pools.values())
                if idle and self._stopping:
                    return
                if idle:
                    self.lock.wait(0.5)
                    continue
                self._admit_queued()
            running = [p for p in self.pools.values() if p.busy]
            for pool in running:
                pool.step()  # dispatched asynchronously: the pools overlap
            for pool in running:
                self._collect(pool)

    def _admit_queued(self) -> None:
        """Moves queued jobs into free slots (under the lock), dropping expired ones."""
        now = time.monotonic()
        for job in [j for j in self.queue if j.deadline < now]:
            self.queue.remove(job)
            job.future.set_exception(Expired("the request timed out while queued"))
        for name, pool in self.pools.items():
            if not self.continuous and pool.busy:
                continue
            free = len(pool.free)
            mine = [j for j in self.queue if (j.width > 1) == (name == "beam")][:free]
            for job in mine:
                self.queue.remove(job)
            if mine:
                pool.admit(mine)

    def _collect(self, pool: Pool) -> None:
        """Hands finished jobs their results, streams greedy tokens, frees expired slots."""
        view = jax.device_get(pool.view)  # waits for the device call
        self.stats["syncs"] += 1
        busy = [s for s, job in enumerate(pool.jobs) if job is not None]
        self.stats["busy_slot_steps"] += len(busy) * pool.steps
        self.stats["slot_steps"] += len(pool.jobs) * pool.steps
        now, expired = time.monotonic(), []
        for s in busy:
            job = pool.jobs[s]
            if view.done[s]:
                nbest = [strip_ids(t) for t in view.tokens[s, : job.nbest]]
                self.stats["tokens"] += len(nbest[0]) + 1
                _stream(job, nbest[0])
                job.future.set_result((nbest, view.scores[s, : job.nbest].tolist()))
                pool.jobs[s] = None
            elif job.deadline < now:
                job.future.set_exception(Expired("the request timed out while decoding"))
                expired.append(s)
            else:
                _stream(job, [t for t in view.live[s, : view.step[s]].tolist() if t != PAD_ID])
        if expired:
            pool.release(expired)


def strip_ids(ids) -> list[int]:
    """Generated ids up to EOS, without it and without PAD_ID (as `decode.py` reads them)."""
    ids = list(ids.tolist() if isinstance(ids, np.ndarray) else ids)
    ids = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
    return [t for t in ids if t != PAD_ID]


def _stream(job: Job, ids: list[int]) -> None:
    """Calls `job.on_tokens` with the ids generated since the last call."""
    if job.on_tokens is not None and len(ids) > job.sent:
        job.on_tokens(ids[job.sent :])
        job.sent = len(ids)


def warm_up(engine: Engine) -> float:
    """Compiles every admission bucket and the step of each pool, before `engine.start()`
    (it drives the pools itself); returns the seconds."""
    if engine.started:
        raise RuntimeError("warm_up runs before Engine.start(), not while the engine runs")
    start = time.perf_counter()
    for name, pool in engine.pools.items():
        width = 1 if name == "greedy" else engine.beam_size
        for rows in pool.rows:
            for length in pool.buckets:
                jobs = [Job(ids=[EOS_ID] * length, width=width, max_len=2) for _ in range(rows)]
                pool.admit(jobs)
                pool.release([j.slot for j in jobs])
        pool.step()
    jax.block_until_ready([p.state for p in engine.pools.values()])
    return time.perf_counter() - start


def params_on_device(params: Any) -> Any:
    """Parameters as device arrays (restored checkpoints may hold host numpy arrays)."""
    return jax.tree.map(jnp.asarray, params)
