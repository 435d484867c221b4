"""Sequence-level knowledge distillation: re-translate a run's training set into a new corpus.

python distill.py --workdir workdirs/default --output_dir data/default_distilled
python distill.py --workdir workdirs/multi30k --output_dir data/multi30k_kd --step best

The training sources are decoded by beam search with the workdir's model; --output_dir gets a
parallel_text corpus (train.*, val.*, test.* and distill.json) whose validation and test
targets are the gold ones. The train.py flags that train on it are printed on stdout.
"""

import sys

from absl import app, flags, logging
from absl.flags import DEFINE_float, DEFINE_integer, DEFINE_string

from flaxformer_lite.cli import common, compilation_cache

FLAGS = flags.FLAGS


def define_flags() -> None:
    DEFINE_string("workdir", None, "Training workdir of the teacher (train.py).", required=True)
    DEFINE_string(
        "output_dir", None, "New corpus directory; must not exist or be empty.", required=True
    )
    DEFINE_string("step", "latest", "latest (default), latest-good, best, or a step number.")
    DEFINE_integer("beam_size", 4, "Beams; 1 decodes greedily.", lower_bound=1)
    DEFINE_float("alpha", 0.6, "Beam-search length-penalty exponent.", lower_bound=0.0)
    DEFINE_integer("batch_size", 64, "Sentences per model call.", lower_bound=1)


@common.friendly_errors
def main(argv):
    if len(argv) > 1:
        common.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax and TFDS are chatty at INFO/WARNING
    from flaxformer_lite.cli import distill
    from flaxformer_lite.translate import distillation, line_io

    compilation_cache.enable(FLAGS.compilation_cache_dir)

    values = {name: FLAGS[name].value for name in distill.Options.names()}
    try:
        manifest = distill.run(distill.Options(**values), on_inputs_checked=common.report_platform)
    except line_io.InputError as e:
        common.fail(str(e))
    print("train on it with:", file=sys.stderr, flush=True)
    print(distillation.shell_line(manifest["train_flags"]), flush=True)


if __name__ == "__main__":
    common.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    define_flags()
    common.define_host_malloc_flag()
    compilation_cache.define_flag()
    app.run(main, flags_parser=common.parse_flags)
