"""Benchmarks of jit performance on whatever devices JAX sees.

python bench.py                          # training and decoding, base model, vocab 8000
python bench.py --mode train --batch 16 --source_len 64 --target_len 64
python bench.py --mode decode --json bench.json
python bench.py --mode sweep             # step time vs batch and length; 1/2/4/8 devices
python bench.py --mode train --compare torch   # vs torch.nn.Transformer (pip install -e ".[torch]")
python bench.py --mode train --config configs/wmt14_ende_big.py   # a run config's model
"""

import json
import os
import subprocess
import sys

from absl import app, flags
from ml_collections import config_flags

from flaxformer_lite.tools import cli

flags.DEFINE_enum("mode", "all", ["all", "train", "decode", "sweep"], "What to measure.")
flags.DEFINE_integer("batch", 16, "Sentences per batch.")
flags.DEFINE_integer("source_len", 64, "Source tokens per sentence.")
flags.DEFINE_integer("target_len", 64, "Target tokens per sentence (training).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sentence (decoding).")
flags.DEFINE_integer("beam_size", 4, "Beams for the beam-search run.")
flags.DEFINE_integer("repeats", 5, "Timed repetitions (median reported).")
flags.DEFINE_integer("vocab_size", 8000, "Vocabulary of the model.")
flags.DEFINE_integer("d_model", 512, "Model width.")
flags.DEFINE_integer("d_ff", 2048, "Feed-forward size.")
flags.DEFINE_integer("num_heads", 8, "Attention heads.")
flags.DEFINE_integer("num_layers", 6, "Encoder and decoder layers each.")
flags.DEFINE_bool("scan_layers", False, "Run the layers as one lax.scan (faster compile).")
flags.DEFINE_bool("remat", False, "With --scan_layers: recompute activations in the backward pass.")
flags.DEFINE_bool("uncached", True, "Also time greedy search without the KV cache.")
flags.DEFINE_string("dtype", "float32", "Compute dtype (parameters stay float32).")
flags.DEFINE_string("json", "", "Write the results to this JSON file.")
flags.DEFINE_enum(
    "compare",
    None,
    ["torch", "torch_compile"],
    "Training: also time a torch.nn.Transformer of the same sizes on the same batch, "
    "alternating with ours (needs PyTorch: pip install -e '.[torch]').",
)
flags.DEFINE_integer(
    "torch_threads", 0, "With --compare: torch's intra-op threads; 0 = every core (os.cpu_count())."
)
config_flags.DEFINE_config_file(
    "config",
    None,
    "A run config (e.g. configs/wmt14_ende_big.py) whose model to time; the size flags above, "
    "when given, and --config.model.x=... override it. Without it: the size flags alone.",
    lock_config=True,
)
cli.define_host_malloc_flag()
FLAGS = flags.FLAGS

# Size flag -> the model fields it sets.
_SIZE_FLAGS = {
    "vocab_size": ("vocab_size",),
    "d_model": ("d_model",),
    "d_ff": ("d_ff",),
    "num_heads": ("num_heads",),
    "num_layers": ("num_encoder_layers", "num_decoder_layers"),
    "dtype": ("dtype",),
    "scan_layers": ("scan_layers",),
    "remat": ("remat",),
}


def _config():
    """The model to time: --config's (its data.vocab_size as the vocabulary), or the flags'."""
    from flaxformer_lite import run_config
    from flaxformer_lite.config import TransformerConfig

    if FLAGS.config is None:
        values = {
            field: FLAGS[flag].value for flag, fields in _SIZE_FLAGS.items() for field in fields
        }
        return TransformerConfig(dropout_rate=0.1, max_len=1024, **values)
    run_config.validate(FLAGS.config)
    config = run_config.planned_model_config(FLAGS.config)
    given = {
        field: FLAGS[flag].value
        for flag, fields in _SIZE_FLAGS.items()
        if FLAGS[flag].present
        for field in fields
    }
    if "vocab_size" in given and config.target_vocab_size is None:
        given["target_vocab_size"] = None
    return config.replace(max_len=max(config.max_len, 1024), **given)


def _model_args() -> list[str]:
    """The flags of this run that define the model, to pass to a child bench.py."""
    args = []
    for name in _SIZE_FLAGS:
        flag = FLAGS[name]
        if not (flag.present or FLAGS.config is None):
            continue
        if isinstance(flag.value, bool):
            args.append(f"--{name}" if flag.value else f"--no{name}")
        else:
            args.append(f"--{name}={flag.value}")
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg.startswith(("--config=", "--config.")):
            args.append(arg)
        elif arg == "--config" and i + 1 < len(argv):
            args.append(f"--config={argv[i + 1]}")
    return args


def _sweep(results):
    from flaxformer_lite.tools import benchmark

    config, peak = _config(), benchmark.matmul_peak()
    quiet = lambda s: None  # noqa: E731
    print("step time vs batch (length 64/64):")
    for b in (4, 8, 16, 32):
        r = benchmark.train_benchmark(config, batch=b, steps=3, peak_flops=peak, log=quiet)
        results[f"sweep_batch{b}"] = r
        print(
            f"  batch {b:>3}: {r['step_s']:.3f} s  {r['tokens_per_s']:.0f} tokens/s  "
            f"MFU {r['mfu']:.1%}"
        )
    print("step time vs length (batch 16):")
    for n in (32, 64, 128):
        r = benchmark.train_benchmark(
            config, batch=16, source_len=n, target_len=n, steps=3, peak_flops=peak, log=quiet
        )
        results[f"sweep_len{n}"] = r
        print(
            f"  length {n:>3}: {r['step_s']:.3f} s  {r['tokens_per_s']:.0f} tokens/s  "
            f"MFU {r['mfu']:.1%}"
        )
    print("data parallel on simulated CPU devices (global batch 16, one process each):")
    base = None
    for devices in (1, 2, 4, 8):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--mode=train",
                "--repeats=3",
                "--json=/dev/stdout",
                f"--batch={FLAGS.batch}",
                *_model_args(),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out[out.index("{") :])
        base = base or r["train"]["step_s"]
        results[f"dp{devices}"] = r["train"]
        print(
            f"  {devices} device(s): {r['train']['step_s']:.3f} s/step  "
            f"speed-up {base / r['train']['step_s']:.2f}x  efficiency "
            f"{base / r['train']['step_s'] / devices:.0%}"
        )


def _check_compare():
    """Fails early, in one line, when `--compare` cannot run."""
    if FLAGS.mode not in ("all", "train"):
        cli.fail(f"--compare times training; use it with --mode train or all, not {FLAGS.mode}")
    try:
        import torch  # noqa: F401
    except ImportError:
        cli.fail(
            f"--compare {FLAGS.compare} needs PyTorch, which is not installed; "
            'pip install -e ".[torch]"'
        )


@cli.friendly_errors
def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.compare:
        _check_compare()
    import jax

    from flaxformer_lite.tools import benchmark

    cli.report_platform()
    config = _config()
    to_stdout = FLAGS.json == "/dev/stdout"
    log = (lambda s: print(s, file=sys.stderr)) if to_stdout else print
    log(
        f"devices: {jax.devices()}; model {config.num_encoder_layers}+"
        f"{config.num_decoder_layers} layers, d_model {config.d_model}, d_ff {config.d_ff}, "
        f"{config.num_heads} heads, vocab {config.vocab_size}, {config.dtype}"
        + (", layers scanned" if config.scan_layers else "")
        + (", rematerialised" if config.remat else "")
    )
    from flaxformer_lite.tools import host_memory

    log(f"host malloc: {'reuse freed memory' if host_memory.applied() else 'system default'}")
    results = {"config": config.to_dict(), "host_malloc_reuse": host_memory.applied()}
    if FLAGS.mode in ("all", "train"):
        log(
            f"training: batch {FLAGS.batch} x {FLAGS.source_len} source x {FLAGS.target_len} "
            "target tokens, Adam, library train step"
        )
        shapes = dict(batch=FLAGS.batch, source_len=FLAGS.source_len, target_len=FLAGS.target_len)
        if FLAGS.compare:
            results["train"] = benchmark.compare_train_benchmark(
                config,
                baseline=FLAGS.compare,
                repeats=FLAGS.repeats,
                threads=FLAGS.torch_threads or None,
                log=log,
                **shapes,
            )
        else:
            results["train"] = benchmark.train_benchmark(
                config, steps=FLAGS.repeats, log=log, **shapes
            )
    if FLAGS.mode in ("all", "decode"):
        log(
            f"decoding: batch {FLAGS.batch}, source {FLAGS.source_len}, {FLAGS.new_tokens} new "
            "tokens"
        )
        results["decode"] = benchmark.decode_benchmark(
            config.replace(dropout_rate=0.0),
            batch=FLAGS.batch,
            source_len=FLAGS.source_len,
            new_tokens=FLAGS.new_tokens,
            beam_size=FLAGS.beam_size,
            repeats=FLAGS.repeats,
            uncached=FLAGS.uncached,
            log=log,
        )
    if FLAGS.mode == "sweep":
        _sweep(results)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    cli.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    if any(a.startswith(("--config=", "--config.")) or a == "--config" for a in sys.argv[1:]):
        cli.check_config_overrides(sys.argv[1:], "")  # one-line errors for bad paths and keys
    app.run(main, flags_parser=cli.parse_flags)
