"""Export a trained workdir to CTranslate2 or Hugging Face, checked against our model.

python export.py --workdir workdirs/default --to ctranslate2 --out exported/ct2
python export.py --workdir workdirs/default --to ctranslate2 --out exported/int8 --quantization int8
    (int8: the difference is measured on this machine; above 0.25 it warns and measures what
    helps: the other GEMM backend, CT2_USE_MKL=1/0, or --int8_weight_bits 7)
python export.py --workdir workdirs/default --to hf --out exported/hf --step best --average 3

Needs the optional extras: pip install -e ".[export]". The output directory holds the
engine's model, the run's SentencePiece model(s) and flaxformer_lite_export.json (the
workdir, step, and the largest log-probability difference from our model on probe pairs).
"""

import sys

from absl import app, flags, logging
from absl.flags import DEFINE_enum, DEFINE_integer, DEFINE_string

from flaxformer_lite.cli import common, compilation_cache

FLAGS = flags.FLAGS


def define_flags() -> None:
    DEFINE_string("workdir", None, "Training workdir written by train.py.", required=True)
    DEFINE_enum("to", None, ["ctranslate2", "hf"], "The engine to export to.", required=True)
    DEFINE_string("out", None, "New (or empty) output directory.", required=True)
    DEFINE_string("step", "latest", "latest (default), latest-good, best, or a step number.")
    DEFINE_integer("average", 1, "Mean params of the last N checkpoints to --step.", lower_bound=1)
    DEFINE_string(
        "quantization",
        "float32",
        "CTranslate2 weights: float32, int8, int8_float32, int16, float16 or bfloat16.",
    )
    DEFINE_integer(
        "int8_weight_bits",
        8,
        "int8 weights in 8 bits (CTranslate2's) or 7 (no saturation on CPUs without VNNI).",
    )
    DEFINE_integer(
        "max_positions", 1024, "Rows of the position table: the longest input or output."
    )
    DEFINE_integer("probes", 16, "Probe pairs scored by both models.", lower_bound=1)


@common.friendly_errors
def main(argv):
    if len(argv) > 1:
        common.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax is chatty at INFO/WARNING
    from flaxformer_lite.cli import export as export_cli
    from flaxformer_lite.export.layout import ExportError

    compilation_cache.enable(FLAGS.compilation_cache_dir)

    values = {name: FLAGS[name].value for name in export_cli.Options.__dataclass_fields__}
    try:
        export_cli.export(export_cli.Options(**values))
    except ExportError as e:
        common.fail(str(e))


if __name__ == "__main__":
    define_flags()
    compilation_cache.define_flag()
    app.run(main, flags_parser=common.parse_flags)
