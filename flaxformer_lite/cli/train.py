"""What `train.py` does with its flag values: join the job, train and evaluate, print the results.

`--dry_run` instead prints the model's parameter table, built abstractly.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from flaxformer_lite.cli import common, compilation_cache


@dataclasses.dataclass(frozen=True)
class Options:
    """The flag values of train.py (see its flag help for each)."""

    config: Any  # the run config (ml_collections), not yet validated
    workdir: str
    dry_run: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = 100
    compilation_cache_dir: str | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def run(o: Options) -> None:
    """Trains (or resumes) the run in `o.workdir`; process 0 prints the final metrics.

    Errors the user can fix end the process with one line (`common.fail`); a preempted
    run prints where it stopped and returns, since rerunning resumes it.
    """
    from flaxformer_lite.config import run as run_config
    from flaxformer_lite.parallel import distributed
    from flaxformer_lite.training import dry_run

    if o.dry_run:
        dry_run.print_parameter_table(run_config.validate(o.config))
        return
    # A bad value fails here, in one line, before waiting for other hosts or reading data;
    # what depends on the platform (a forced kernel, a dtype "auto") is settled once the job
    # is joined, since JAX's backends must not start before jax.distributed.initialize.
    run_config.validate(o.config, platform=False)
    from tqdm import tqdm

    # tqdm.write: a hit during training does not tear the progress bar.
    compilation_cache.enable(o.compilation_cache_dir, log=lambda s: tqdm.write(s, file=sys.stderr))
    try:
        # Before anything touches devices: the processes must first find each other.
        distributed.initialize_distributed(
            o.coordinator_address,
            o.num_processes,
            o.process_id,
            heartbeat_timeout_s=o.heartbeat_timeout_s,
        )
    except distributed.DistributedError as e:
        common.fail(str(e))
    import jax

    from flaxformer_lite.training import evaluate, loop
    from flaxformer_lite.training.nonfinite import NonFiniteError
    from flaxformer_lite.training.preemption import Preempted

    try:
        run = run_config.validate(o.config)  # the config is parsed once, here
        results = loop.train_and_evaluate(run, o.workdir, on_checked=common.report_platform)
    except Preempted as e:  # a clean stop: the checkpoint is saved, rerunning resumes
        if jax.process_index() == 0:
            print(str(e), file=sys.stderr)
        return
    except distributed.DistributedError as e:
        common.fail(str(e))
    except NonFiniteError as e:
        common.fail(str(e), code=1)
    if jax.process_index() == 0:
        # The exposure report's details are in metrics.jsonl and its printed table.
        shown = {k: v for k, v in results.items() if not evaluate.is_exposure_detail(k)}
        print(
            " ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
            )
        )
        sys.stdout.flush()
