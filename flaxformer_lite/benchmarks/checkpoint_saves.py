"""How long a checkpoint save holds up training: synchronous against asynchronous saves.

  python -m flaxformer_lite.benchmarks.checkpoint_saves --config configs/wmt14_ende_base.py

Builds the config's model and Adam state, then runs `--steps` train steps on a
random batch and saves every `--save_every` steps, first with one kind of save
and then the other, `--rounds` times alternating. Prints per kind the median
time the step path spent in `Checkpointer.save` (blocked), the median step
time, and the wall time of the whole loop, the final wait included. (An
asynchronous save also blocks while the previous one is still in flight.)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time

import jax


def _model_config(path: str):
    spec = importlib.util.spec_from_file_location("_bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from flaxformer_lite.config import run as run_config

    return run_config.parse(module.get_config()).model


def measure(run, state, steps: int, save_every: int, asynchronous: bool) -> dict[str, float]:
    """Seconds: median blocked save, median step, total (the last save's wait included)."""
    from flaxformer_lite.training.checkpoints import Checkpointer

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as workdir:
        ckpt = Checkpointer(workdir, keep=2, save_every=1, asynchronous=asynchronous)
        blocked, step_s = [], []
        start = time.perf_counter()
        for i in range(1, steps + 1):
            t0 = time.perf_counter()
            state = run(state)
            jax.block_until_ready(state)
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            if i % save_every == 0:
                ckpt.save(i, state, {})
                blocked.append(time.perf_counter() - t1)
        ckpt.close()
        total = time.perf_counter() - start
    return {
        "blocked_s": statistics.median(blocked),
        "step_s": statistics.median(step_s),
        "total_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/wmt14_ende_base.py")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import optax

    from flaxformer_lite.benchmarks.train_speed import _random_batch
    from flaxformer_lite.models.autoregressive import AutoregressiveModel
    from flaxformer_lite.parallel import partitioning
    from flaxformer_lite.training.state import create_state
    from flaxformer_lite.training.step import jit_train_step

    config = _model_config(args.config)
    model = AutoregressiveModel(config, label_smoothing=0.1)
    tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
    mesh = partitioning.make_mesh()
    arrays = _random_batch(config, args.batch, args.length, args.length)
    state, shardings = create_state(
        model, tx, mesh, seed=0, source_len=args.length, target_len=args.length
    )
    batch = partitioning.put_batch(arrays, mesh)
    step = jit_train_step(model, tx, mesh, shardings)
    run = lambda s: step(s, batch)[0]  # noqa: E731
    state = run(state)  # compiles
    mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    print(
        f"{args.config}: train state {mib:.0f} MiB, {args.steps} steps, "
        f"a save every {args.save_every}"
    )
    for r in range(args.rounds):
        for asynchronous in (False, True):
            m = measure(run, state, args.steps, args.save_every, asynchronous)
            kind = "async" if asynchronous else "sync "
            print(
                f"round {r + 1} {kind}: blocked per save {m['blocked_s']:.2f} s (median), "
                f"step {m['step_s']:.2f} s (median), loop {m['total_s']:.1f} s"
            )


if __name__ == "__main__":
    main()
