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

from flaxformer_lite.cli import common, compilation_cache

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


@common.friendly_errors
def main(argv):
    if len(argv) > 1:
        common.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax and TFDS are chatty at INFO/WARNING
    from flaxformer_lite.cli import train

    train.run(train.Options(**{name: FLAGS[name].value for name in train.Options.names()}))


if __name__ == "__main__":
    common.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    # Overrides are applied while the config flag is defined, so check them first.
    common.check_config_overrides(sys.argv[1:], _DEFAULT_CONFIG)
    define_flags()
    common.define_host_malloc_flag()
    compilation_cache.define_flag()
    app.run(main, flags_parser=common.parse_flags)
