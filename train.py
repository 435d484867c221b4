"""Train (or resume) an encoder-decoder Transformer.

  python train.py                                  # the embedded default task
  python train.py --config configs/default.py --workdir runs/numbers \
      --config.model.num_encoder_layers=2 --config.train.num_steps=500
  python train.py --config configs/wmt14_ende_base.py --dry_run
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from flaxformer_lite.cli import friendly_errors

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file(
    "config", os.path.join(_HERE, "configs", "default.py"), "Run config file (get_config()).",
    lock_config=True,
)
flags.DEFINE_string("workdir", "workdirs/default", "Checkpoints, vocabulary and metrics go here; "
                    "an existing run in it is resumed.")
flags.DEFINE_bool("dry_run", False, "Build the model abstractly, print its parameters, exit.")
FLAGS = flags.FLAGS


@friendly_errors
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if "--verbosity" not in " ".join(sys.argv) and "-v=" not in " ".join(sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax and TFDS are chatty at INFO/WARNING
    from flaxformer_lite import dry_run, train_lib

    if FLAGS.dry_run:
        dry_run.print_parameter_table(FLAGS.config)
        return
    results = train_lib.train_and_evaluate(FLAGS.config, FLAGS.workdir)
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in results.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
