"""Benchmarks of jit performance.

python bench.py                       # decoding, base config (vocab 8000), CPU-sized shapes
python bench.py --batch 16 --new_tokens 64 --beam_size 4 --json bench.json
"""

import json
import sys

from absl import app, flags

from flaxformer_lite import cli

flags.DEFINE_integer("batch", 16, "Sentences per batch.")
flags.DEFINE_integer("source_len", 64, "Source tokens per sentence.")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sentence.")
flags.DEFINE_integer("beam_size", 4, "Beams for the beam-search run.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).")
flags.DEFINE_integer("vocab_size", 8000, "Vocabulary of the base model.")
flags.DEFINE_bool("uncached", True, "Also time greedy search without the KV cache.")
flags.DEFINE_string("dtype", "float32", "Compute dtype.")
flags.DEFINE_string("json", "", "Write the results to this JSON file.")
FLAGS = flags.FLAGS


@cli.friendly_errors
def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax

    from flaxformer_lite import benchmark
    from flaxformer_lite.config import TransformerConfig

    config = TransformerConfig(
        vocab_size=FLAGS.vocab_size, dropout_rate=0.0, max_len=1024, dtype=FLAGS.dtype
    )
    print(
        f"devices: {jax.devices()}  base model (6+6 layers, d_model 512, d_ff 2048, 8 heads, "
        f"vocab {FLAGS.vocab_size}), batch {FLAGS.batch}, source {FLAGS.source_len}, "
        f"{FLAGS.new_tokens} new tokens"
    )
    results = benchmark.decode_benchmark(
        config,
        batch=FLAGS.batch,
        source_len=FLAGS.source_len,
        new_tokens=FLAGS.new_tokens,
        beam_size=FLAGS.beam_size,
        repeats=FLAGS.repeats,
        uncached=FLAGS.uncached,
    )
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
