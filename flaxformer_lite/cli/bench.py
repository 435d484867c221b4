"""What `bench.py` runs: the model to time from flags or a run config, then the benchmarks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from flaxformer_lite.cli import common


@dataclasses.dataclass(frozen=True)
class Options:
    """bench.py's flags, which of them were given, its argv and its path."""

    flags: Any  # attribute per flag: bench.py's parsed flag values
    present: frozenset[str]  # the flags given on the command line
    argv: list[str]
    script: str


# Size flag -> the model fields it sets.
_SIZE_FLAGS = {
    "vocab_size": ("vocab_size",),
    "d_model": ("d_model",),
    "d_ff": ("d_ff",),
    "num_heads": ("num_heads",),
    "num_layers": ("num_encoder_layers", "num_decoder_layers"),
    "dtype": ("dtype",),
    "attention_impl": ("attention_impl",),
    "scan_layers": ("scan_layers",),
    "remat": ("remat",),
}


def _size_values(opts: Options, only_present: bool) -> dict:
    """The model fields the size flags set ("auto" dtype resolved for this platform)."""
    from flaxformer_lite.config.model import parse_dtype

    values = {
        field: getattr(opts.flags, flag)
        for flag, fields in _SIZE_FLAGS.items()
        if not only_present or flag in opts.present
        for field in fields
    }
    if "dtype" in values:
        values["dtype"] = parse_dtype("dtype", values["dtype"])
    return values


def model_config(opts: Options):
    """The model to time: --config's (its data.vocab_size as the vocabulary), or the flags'."""
    from flaxformer_lite.config import TransformerConfig
    from flaxformer_lite.config import run as run_config
    from flaxformer_lite.nn import kernels

    kernels.check_platform(opts.flags.attention_impl)
    if opts.flags.config is None:
        values = _size_values(opts, only_present=False)
        return TransformerConfig(dropout_rate=0.1, max_len=1024, **values)
    config = run_config.validate(opts.flags.config).model
    given = _size_values(opts, only_present=True)
    if "vocab_size" in given and config.target_vocab_size is None:
        given["target_vocab_size"] = None
    return config.replace(max_len=max(config.max_len, 1024), **given)


def _model_args(opts: Options) -> list[str]:
    """The flags of this run that define the model, to pass to a child bench.py."""
    args = []
    for name in _SIZE_FLAGS:
        value = getattr(opts.flags, name)
        if not (name in opts.present or opts.flags.config is None):
            continue
        if isinstance(value, bool):
            args.append(f"--{name}" if value else f"--no{name}")
        else:
            args.append(f"--{name}={value}")
    argv = opts.argv
    for i, arg in enumerate(argv):
        if arg.startswith(("--config=", "--config.")):
            args.append(arg)
        elif arg == "--config" and i + 1 < len(argv):
            args.append(f"--config={argv[i + 1]}")
    return args


def _sweep(opts: Options, results):
    from flaxformer_lite.benchmarks import train_speed

    config, peak = model_config(opts), train_speed.matmul_peak()
    quiet = lambda s: None  # noqa: E731
    print("step time vs batch (length 64/64):")
    for b in (4, 8, 16, 32):
        r = train_speed.train_benchmark(config, batch=b, steps=3, peak_flops=peak, log=quiet)
        results[f"sweep_batch{b}"] = r
        print(
            f"  batch {b:>3}: {r['step_s']:.3f} s  {r['tokens_per_s']:.0f} tokens/s  "
            f"MFU {r['mfu']:.1%}"
        )
    print("step time vs length (batch 16):")
    for n in (32, 64, 128):
        r = train_speed.train_benchmark(
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
                opts.script,
                "--mode=train",
                "--repeats=3",
                "--json=/dev/stdout",
                f"--batch={opts.flags.batch}",
                *_model_args(opts),
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


def _length_sweep(opts: Options, log) -> list[dict]:
    """--length_sweep: full vs local encoder self-attention, step time and memory vs length."""
    import jax

    from flaxformer_lite.benchmarks import length_sweep

    f = opts.flags
    try:
        lengths = [int(n) for n in f.length_sweep]
    except ValueError:
        common.fail(f"--length_sweep takes integers, got {','.join(f.length_sweep)}")
    if any(n < 1 for n in lengths):
        common.fail("--length_sweep lengths must be positive")
    sizes = {"d_model": 256, "num_heads": 4, "d_ff": 1024, "num_layers": 2, "dtype": "float32"}
    given = {name: getattr(f, name) for name in sizes if name in opts.present}
    sizes.update(given)
    config = length_sweep.sweep_config(
        input_features=f.input_features,
        d_model=sizes["d_model"],
        num_heads=sizes["num_heads"],
        d_ff=sizes["d_ff"],
        num_encoder_layers=sizes["num_layers"],
        dtype=sizes["dtype"],
        max_len=max(lengths),
    )
    log(
        f"devices: {jax.devices()}; encoder forward+backward, batch {f.batch_sweep}, "
        f"{config.input_features} features, d_model {config.d_model}, {config.num_heads} heads, "
        f"{config.num_encoder_layers} layers, d_ff {config.d_ff}; local window {f.window}; "
        f"memory: XLA's estimate (arguments + outputs + temporaries); time: median of "
        f"{f.repeats} runs, skipped where the estimate is over {f.max_run_mib:.0f} MiB"
    )
    log(length_sweep.HEADER)
    rows = length_sweep.length_sweep(
        lengths,
        f.window,
        config=config,
        batch=f.batch_sweep,
        repeats=f.repeats,
        max_run_mib=f.max_run_mib,
        log=log,
    )
    log("(x: MiB over the previous length's; 2 = linear, 4 = quadratic per doubling)")
    return rows


def check_compare(opts: Options) -> None:
    """Fails early, in one line, when `--compare` cannot run."""
    if opts.flags.compare == "ctranslate2":
        _check_compare_ctranslate2(opts.flags)
        return
    if opts.flags.mode not in ("all", "train"):
        common.fail(
            f"--compare times training; use it with --mode train or all, not {opts.flags.mode}"
        )
    try:
        import torch  # noqa: F401
    except ImportError:
        common.fail(
            f"--compare {opts.flags.compare} needs PyTorch, which is not installed; "
            'pip install -e ".[torch]"'
        )


def _check_compare_ctranslate2(f) -> None:
    if f.mode != "decode":
        common.fail(
            f"--compare ctranslate2 times decoding; use it with --mode decode, not {f.mode}"
        )
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        common.fail("--compare ctranslate2 needs CTranslate2, which is not installed; "
                 'pip install -e ".[export]"')  # fmt: skip
    try:
        batches = [int(b) for b in f.compare_batches]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        common.fail(f"--compare_batches takes positive integers, got {','.join(f.compare_batches)}")
    given = [f.compare_workdir, f.compare_input, f.compare_reference]
    if any(given) and not all(given):
        common.fail("--compare_workdir, --compare_input and --compare_reference go together")
    for path in given[1:]:
        if path and not os.path.isfile(path):
            common.fail(f"{path} is not a file")


def _compare_ctranslate2(f, config, log) -> dict:
    from flaxformer_lite.benchmarks import engine_compare

    log(
        f"decoding against CTranslate2 on the same (random) weights: source {f.source_len}, "
        f"{f.new_tokens} new tokens, median of {f.repeats} interleaved rounds"
    )
    log(engine_compare.HEADER)
    results = engine_compare.compare_decode_benchmark(
        config.replace(dropout_rate=0.0),
        batch_sizes=tuple(int(b) for b in f.compare_batches),
        source_len=f.source_len,
        new_tokens=f.new_tokens,
        beam_size=f.beam_size,
        repeats=f.repeats,
        log=log,
    )
    if f.compare_workdir:
        batches = tuple(int(b) for b in f.compare_batches)
        log(f"{f.compare_workdir} on {f.compare_input}, all of it, batch {batches}:")
        results["file"] = engine_compare.file_bleu(
            f.compare_workdir,
            f.compare_input,
            f.compare_reference,
            beam_size=f.beam_size,
            batch_sizes=batches,
            log=log,
        )
    return results


def _describe(config, log) -> None:
    import jax

    log(
        f"devices: {jax.devices()}; model {config.num_encoder_layers}+"
        f"{config.num_decoder_layers} layers, d_model {config.d_model}, d_ff {config.d_ff}, "
        f"{config.num_heads} heads, vocab {config.vocab_size}, {config.dtype}"
        + (", layers scanned" if config.scan_layers else "")
        + (f", remat {config.remat}" if config.remat != "none" else "")
    )
    from flaxformer_lite.nn import precision

    log(precision.describe(config))


def _train(f, config, log) -> dict:
    from flaxformer_lite.benchmarks import train_speed

    log(
        f"training: batch {f.batch} x {f.source_len} source x {f.target_len} "
        "target tokens, Adam, library train step"
    )
    shapes = dict(batch=f.batch, source_len=f.source_len, target_len=f.target_len)
    sampling = _scheduled_sampling(f)
    if sampling is not None:
        return train_speed.scheduled_sampling_benchmark(
            config, sampling, repeats=f.repeats, log=log, **shapes
        )
    if f.compare:
        return train_speed.compare_train_benchmark(
            config,
            baseline=f.compare,
            repeats=f.repeats,
            threads=f.torch_threads or None,
            log=log,
            **shapes,
        )
    return train_speed.train_benchmark(config, steps=f.repeats, log=log, **shapes)


def _input(f, train: dict | None, log) -> dict:
    """The input pipeline's examples/s, and beside it the train step's (when timed)."""
    from flaxformer_lite.benchmarks.input_pipeline import input_benchmark
    from flaxformer_lite.config import run as run_config

    results = input_benchmark(run_config.parse(f.config), f.input_batches, log)
    if train and "step_s" in train:
        step_rate = f.batch / train["step_s"]
        log(
            f"examples/s: input {results['examples_per_s']:.0f}, train step {step_rate:.0f} "
            f"(batch {f.batch}); the input pipeline is "
            f"{results['examples_per_s'] / step_rate:.1f}x as fast as the step"
        )
        results["train_step_examples_per_s"] = step_rate
    return results


def _scheduled_sampling(f):
    """The scheduled sampling to time against teacher forcing: --config's section with
    --scheduled_sampling's mode when given; None when neither turns it on."""
    from flaxformer_lite.config import variants

    sampling = variants.ScheduledSampling()
    if f.config is not None:
        sampling = variants.scheduled_sampling_section(f.config)
    if f.scheduled_sampling:
        sampling = dataclasses.replace(sampling, mode=f.scheduled_sampling)
    return sampling if sampling.enabled else None


def _decode(f, config, log) -> dict:
    from flaxformer_lite.benchmarks import decoding

    log(f"decoding: batch {f.batch}, source {f.source_len}, {f.new_tokens} new tokens")
    return decoding.decode_benchmark(
        config.replace(dropout_rate=0.0),
        batch=f.batch,
        source_len=f.source_len,
        new_tokens=f.new_tokens,
        beam_size=f.beam_size,
        repeats=f.repeats,
        uncached=f.uncached,
        nat_iterations=tuple(int(t) for t in f.nat_iterations),
        nat_length_beam=f.nat_length_beam,
        ctc_ratios=tuple(float(r) for r in f.ctc_ratios),
        log=log,
    )


def run(opts: Options) -> dict:
    """Measures what the flags ask for, logs it, writes --json; returns the results."""
    from flaxformer_lite.cli import bench_workdirs, host_memory

    f = opts.flags
    log = (lambda s: print(s, file=sys.stderr)) if f.json == "/dev/stdout" else print
    if f.mode in ("serve", "files") or f.length_sweep:
        if f.mode == "serve":
            results = bench_workdirs.serve(f, log)
        elif f.mode == "files":
            results = bench_workdirs.files(f, log)
        else:
            results = {"length_sweep": _length_sweep(opts, log)}
        if f.json:
            with open(f.json, "w") as out:
                json.dump(results, out, indent=2)
        return results
    config = model_config(opts)
    _describe(config, log)
    log(f"host malloc: {'reuse freed memory' if host_memory.applied() else 'system default'}")
    results = {"config": config.to_dict(), "host_malloc_reuse": host_memory.applied()}
    if f.mode in ("all", "train"):
        results["train"] = _train(f, config, log)
    if f.config is not None and f.mode in ("input", "train"):
        results["input"] = _input(f, results.get("train"), log)
    if f.compare == "ctranslate2":
        results["compare_ctranslate2"] = _compare_ctranslate2(f, config, log)
    elif f.mode in ("all", "decode"):
        results["decode"] = _decode(f, config, log)
    if f.mode == "sweep":
        _sweep(opts, results)
    if f.json:
        with open(f.json, "w") as out:
            json.dump(results, out, indent=2)
    sys.stdout.flush()
    return results
