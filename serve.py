"""Serve a trained workdir over HTTP, with continuous batching of greedy and beam requests.

python serve.py --workdir workdirs/default --port 8080
curl -s localhost:8080/translate -d '{"text": ["en 4721"], "beam_size": 4, "nbest": 2}'
curl -sN localhost:8080/translate -d '{"text": ["en 4721"], "beam_size": 1, "stream": true}'
curl -s localhost:8080/health; curl -s localhost:8080/metrics

SIGTERM or Ctrl-C: new requests are refused, those in flight are answered, then it exits 0.
"""

import sys

from absl import app, flags, logging
from absl.flags import DEFINE_bool, DEFINE_enum, DEFINE_float, DEFINE_integer, DEFINE_string

from flaxformer_lite.cli import common, compilation_cache

FLAGS = flags.FLAGS


def define_flags() -> None:
    DEFINE_string("workdir", None, "Training workdir written by train.py.", required=True)
    DEFINE_string("step", "latest", "latest (default), latest-good, best, or a step number.")
    DEFINE_integer("average", 1, "Mean params of the last N checkpoints to --step.", lower_bound=1)
    DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    DEFINE_integer("port", 8080, "TCP port.", lower_bound=0)
    DEFINE_integer(
        "slots", 16, "Sentences decoded at once, per pool (greedy, beam).", lower_bound=1
    )
    DEFINE_integer(
        "beam_size",
        4,
        "Beams per slot of the beam pool: the largest beam_size a "
        "request may ask (1: greedy only).",
        lower_bound=1,
    )
    DEFINE_integer("default_beam_size", 4, "beam_size of a request that names none.", lower_bound=1)
    DEFINE_integer("max_len", None, "Tokens a slot may generate (default: data.max_target_len).")
    DEFINE_integer(
        "steps_per_sync",
        4,
        "Decoding steps per device call; between calls "
        "finished sentences leave and waiting ones join.",
        lower_bound=1,
    )
    DEFINE_integer(
        "max_queue", 512, "Sentences waiting at most; past it requests get 503.", lower_bound=1
    )
    DEFINE_integer("max_lines", 256, "Lines per request at most (more: 413).", lower_bound=1)
    DEFINE_float("timeout", 60.0, "Seconds a request may take (then 504).", lower_bound=0.1)
    DEFINE_enum(
        "batching",
        "continuous",
        ["continuous", "static"],
        "continuous: a finished sentence's slot is refilled at the next sync; static: "
        "a pool is refilled only once all its sentences finished (the baseline).",
    )
    DEFINE_bool("warm_up", True, "Compile every program before listening.")


@common.friendly_errors
def main(argv):
    if len(argv) > 1:
        common.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)
    from flaxformer_lite.cli import serve as serve_cli
    from flaxformer_lite.translate import line_io

    compilation_cache.enable(FLAGS.compilation_cache_dir)
    values = {name: FLAGS[name].value for name in serve_cli.Options.names()}
    try:
        serve_cli.run(serve_cli.Options(**values), on_ready=common.report_platform)
    except line_io.InputError as e:
        common.fail(str(e))


if __name__ == "__main__":
    common.set_host_malloc(sys.argv[1:])
    define_flags()
    common.define_host_malloc_flag()
    compilation_cache.define_flag()
    app.run(main, flags_parser=common.parse_flags)
