"""Train (or resume) an encoder-decoder Transformer.

  python train.py                                  # the embedded default task
  python train.py --config configs/default.py --workdir workdirs/numbers \
      --config.model.num_encoder_layers=2 --config.train.num_steps=500
  python train.py --config configs/wmt14_ende_base.py --dry_run

On several hosts, run on host i (i = 0 .. N-1; host0 runs process 0):
  python train.py --config ... --workdir /shared/run \
      --coordinator_address=host0:1234 --num_processes=N --process_id=i
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from flaxformer_lite.tools import cli, compilation_cache

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
FLAGS = flags.FLAGS


def define_flags() -> None:
    config_flags.DEFINE_config_file(
        "config", _DEFAULT_CONFIG, "Run config file (get_config()).", lock_config=True
    )
    flags.DEFINE_string(
        "workdir",
        "workdirs/default",
        "Checkpoints, vocabulary and metrics go here; an existing run in it is resumed.",
    )
    flags.DEFINE_bool("dry_run", False, "Build the model abstractly, print its parameters, exit.")
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "Multi-host: host:port of process 0, the same on every process "
        "(default: $JAX_COORDINATOR_ADDRESS).",
    )
    flags.DEFINE_integer(
        "num_processes", None, "Multi-host: number of processes (default: $JAX_NUM_PROCESSES)."
    )
    flags.DEFINE_integer(
        "process_id",
        None,
        "Multi-host: this process, 0 .. num_processes - 1 (default: $JAX_PROCESS_ID).",
    )
    flags.DEFINE_integer(
        "heartbeat_timeout_s",
        100,
        "Multi-host: a process that sends no heartbeat for this many seconds (it died, or its "
        "host is unreachable) is declared dead and the JAX runtime ends the other processes, "
        "instead of leaving them hanging in the next collective; restarting them all resumes "
        "from the last checkpoint. Heartbeats come from a runtime thread, so a long step or "
        "compilation does not miss them.",
        lower_bound=1,
    )


@cli.friendly_errors
def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax and TFDS are chatty at INFO/WARNING
    from flaxformer_lite.config import run as run_config
    from flaxformer_lite.parallel import distributed
    from flaxformer_lite.tools import dry_run

    if FLAGS.dry_run:
        dry_run.print_parameter_table(run_config.validate(FLAGS.config))
        return
    # A bad value fails here, in one line, before waiting for other hosts or reading data;
    # what depends on the platform (a forced kernel, a dtype "auto") is settled once the job
    # is joined, since JAX's backends must not start before jax.distributed.initialize.
    run_config.validate(FLAGS.config, platform=False)
    from tqdm import tqdm

    # tqdm.write: a hit during training does not tear the progress bar.
    compilation_cache.enable(
        FLAGS.compilation_cache_dir, log=lambda s: tqdm.write(s, file=sys.stderr)
    )
    try:
        # Before anything touches devices: the processes must first find each other.
        distributed.initialize_distributed(
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            heartbeat_timeout_s=FLAGS.heartbeat_timeout_s,
        )
    except distributed.DistributedError as e:
        cli.fail(str(e))
    import jax

    from flaxformer_lite.training import evaluate, loop
    from flaxformer_lite.training.nonfinite import NonFiniteError
    from flaxformer_lite.training.preemption import Preempted

    try:
        run = run_config.validate(FLAGS.config)  # the config is parsed once, here
        results = loop.train_and_evaluate(run, FLAGS.workdir, on_checked=cli.report_platform)
    except Preempted as e:  # a clean stop: the checkpoint is saved, rerunning resumes
        if jax.process_index() == 0:
            print(str(e), file=sys.stderr)
        return
    except distributed.DistributedError as e:
        cli.fail(str(e))
    except NonFiniteError as e:
        cli.fail(str(e), code=1)
    if jax.process_index() == 0:
        # The exposure report's details are in metrics.jsonl and its printed table.
        shown = {k: v for k, v in results.items() if not evaluate.is_exposure_detail(k)}
        print(
            " ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
            )
        )
        sys.stdout.flush()


if __name__ == "__main__":
    cli.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    # Overrides are applied while the config flag is defined, so check them first.
    cli.check_config_overrides(sys.argv[1:], _DEFAULT_CONFIG)
    define_flags()
    cli.define_host_malloc_flag()
    compilation_cache.define_flag()
    app.run(main, flags_parser=cli.parse_flags)
