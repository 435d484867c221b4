"""Benchmarks of jit performance on whatever devices JAX sees.

python bench.py                          # training and decoding, base model, vocab 8000
python bench.py --mode train --batch 16 --source_len 64 --target_len 64
python bench.py --mode decode --json bench.json
python bench.py --mode decode --nat_iterations 1,10 --ctc_ratios 2,3   # NAT next to AT
python bench.py --mode sweep             # step time vs batch and length; 1/2/4/8 devices
python bench.py --mode lower             # exported for cuda and tpu; collectives on 8 devices
python bench.py --mode serve --serve_workdir W --serve_input test.en   # serve.py vs decode.py
python bench.py --mode files --files_entry greedy=W:beam_size=1 --files_entry ctc=W2 \
    --files_input test.en --files_reference test.de --files_limit 300   # workdirs in turn
python bench.py --mode train --compare torch   # vs torch.nn.Transformer (pip install -e ".[torch]")
python bench.py --mode decode --compare ctranslate2   # vs CTranslate2 on the same weights
python bench.py --mode train --config configs/wmt14_ende_big.py   # a run config's model
python bench.py --mode input --config configs/default.py   # its input pipeline alone
python bench.py --mode train --config configs/default.py --scheduled_sampling argmax
python bench.py --length_sweep 256,512,1024,2048,4096,8192,16384 --window 64
                                         # encoder step time, memory vs length: full vs local
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from flaxformer_lite.cli import common, compilation_cache

flags.DEFINE_enum(
    "mode",
    "all",
    ["all", "train", "decode", "sweep", "input", "lower", "serve", "files"],
    "What to measure. input: the training input pipeline alone (needs --config); with "
    "--config, train also times it, and prints the examples/s of both. lower: export every "
    "program for cuda and tpu from this host and print its custom calls, float32 matmuls "
    "and (on --lower_devices simulated devices) collectives. serve: serve.py under load "
    "against decode.py on --serve_input (needs --serve_workdir). files: trained workdirs "
    "decoding --files_input in turn, as decode.py does (needs --files_entry).",
)
flags.DEFINE_integer(
    "input_batches", 50, "--mode input/train with --config: batches timed.", lower_bound=1
)
flags.DEFINE_list(
    "lower_programs",
    [],
    "--mode lower: these programs only (default: all; see benchmarks/lowering).",
)
flags.DEFINE_integer(
    "lower_devices", 8, "--mode lower: simulated CPU devices for the collectives.", lower_bound=1
)
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
flags.DEFINE_string(
    "remat",
    "none",
    "Per layer, what the backward pass recomputes instead of storing (model.remat): none, "
    "full, nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable.",
)
flags.DEFINE_bool("uncached", True, "Also time greedy search without the KV cache.")
flags.DEFINE_enum(
    "dtype",
    "auto",
    ["auto", "float32", "bfloat16", "float16"],
    "Compute dtype: auto = bfloat16 on GPU/TPU, float32 on CPU (parameters stay float32).",
)
flags.DEFINE_enum(
    "attention_impl",
    "auto",
    ["auto", "vmap", "fast", "cudnn", "splash"],
    "Attention kernel (nn/kernels.py): auto = cuDNN on GPU, splash on TPU, XLA on CPU.",
)
flags.DEFINE_list(
    "nat_iterations",
    [],
    "Decoding: also time the non-autoregressive model of the same size with these Mask-Predict "
    "iteration counts, e.g. 1,4,10 (1: single pass).",
)
flags.DEFINE_integer(
    "nat_length_beam",
    1,
    "Length candidates per sentence of the non-autoregressive runs.",
    lower_bound=1,
)
flags.DEFINE_list(
    "ctc_ratios",
    [],
    "Decoding: also time the CTC non-autoregressive model of the same size (one decoder call, "
    "argmax and collapse) at these upsampling ratios, e.g. 2,3.",
)
flags.DEFINE_string("json", "", "Write the results to this JSON file.")
flags.DEFINE_string("serve_workdir", None, "--mode serve: the trained workdir to serve.")
flags.DEFINE_string("serve_input", None, "--mode serve: source lines, one per request.")
flags.DEFINE_integer("serve_clients", 32, "--mode serve: concurrent clients.", lower_bound=1)
flags.DEFINE_integer("serve_slots", 32, "--mode serve: serve.py --slots.", lower_bound=1)
flags.DEFINE_float("serve_duration", 20.0, "--mode serve: seconds of each open-loop load.")
flags.DEFINE_multi_string(
    "files_entry",
    [],
    "--mode files: LABEL=WORKDIR[:key=value,...], repeatable; keys: decode.py's beam_size, "
    "alpha, iterations, length_beam, length_scale, max_len, step, average, batching "
    "(e.g. beam4=/w/at:beam_size=4, mp10=/w/nat:iterations=10, ctc=/w/ctc).",
)
flags.DEFINE_string("files_input", None, "--mode files: the source lines to decode.")
flags.DEFINE_string("files_reference", None, "--mode files: their references (BLEU, repeats).")
flags.DEFINE_list("files_batches", ["1", "64"], "--mode files: batch sizes (decode.py's).")
flags.DEFINE_integer("files_limit", 0, "--mode files: the first lines (0: all).", lower_bound=0)
flags.DEFINE_enum(
    "compare",
    None,
    ["torch", "torch_compile", "ctranslate2"],
    "Training (torch, torch_compile): also time a torch.nn.Transformer of the same sizes on "
    "the same batch, alternating with ours (needs PyTorch: pip install -e '.[torch]'). "
    "Decoding (ctranslate2): the same weights exported to CTranslate2 float32 and int8, "
    "greedy and beam at each --compare_batches, interleaved (pip install -e '.[export]').",
)
flags.DEFINE_list("compare_batches", ["1", "16", "32"], "--compare ctranslate2: batch sizes.")
flags.DEFINE_string(
    "compare_workdir",
    None,
    "--compare ctranslate2: also decode --compare_input with this trained workdir's model in "
    "all three engines and score sacreBLEU against --compare_reference.",
)
flags.DEFINE_string("compare_input", None, "--compare_workdir: source lines.")
flags.DEFINE_string("compare_reference", None, "--compare_workdir: reference lines.")
flags.DEFINE_enum(
    "scheduled_sampling",
    None,
    ["argmax", "sample", "soft"],
    "Training: time the train step with this scheduled-sampling mixing (the other settings "
    "from --config's scheduled_sampling section) against the teacher-forced step, alternating.",
)
flags.DEFINE_integer(
    "torch_threads", 0, "With --compare: torch's intra-op threads; 0 = every core (os.cpu_count())."
)
flags.DEFINE_list(
    "length_sweep",
    [],
    "Instead of the modes: time and measure the encoder (float features, batch --batch_sweep) "
    "forward+backward at these lengths, full vs local self-attention with --window, e.g. "
    "256,512,1024. Model: d_model 256, 4 heads, 2 layers unless the size flags are given.",
)
flags.DEFINE_integer("window", 64, "--length_sweep: the local attention window r.", lower_bound=1)
flags.DEFINE_integer("input_features", 80, "--length_sweep: features per frame.", lower_bound=1)
flags.DEFINE_integer("batch_sweep", 1, "--length_sweep: sequences per batch.", lower_bound=1)
flags.DEFINE_float(
    "max_run_mib",
    4096.0,
    "--length_sweep: run (time) a program only when XLA's memory estimate is under this.",
)
config_flags.DEFINE_config_file(
    "config",
    None,
    "A run config (e.g. configs/wmt14_ende_big.py) whose model to time; the size flags above, "
    "when given, and --config.model.x=... override it. Without it: the size flags alone.",
    lock_config=True,
)
common.define_host_malloc_flag()
compilation_cache.define_flag(off_because="since the compile times reported would be cache loads")
FLAGS = flags.FLAGS


@common.friendly_errors
def main(argv):
    if len(argv) > 1:
        common.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    from flaxformer_lite.cli import bench as bench_cli

    present = frozenset(name for name in FLAGS if FLAGS[name].present)
    opts = bench_cli.Options(FLAGS, present, sys.argv[1:], os.path.abspath(__file__))
    if FLAGS.compare:
        bench_cli.check_compare(opts)
    if FLAGS.mode == "lower":
        from flaxformer_lite.cli import bench_lowering

        bench_lowering.lower(opts)
        return
    if FLAGS.mode == "input" and FLAGS.config is None:
        common.fail("--mode input times a run config's input pipeline: pass --config configs/...")
    compilation_cache.enable(FLAGS.compilation_cache_dir)
    common.report_platform()
    bench_cli.run(opts)


if __name__ == "__main__":
    common.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    if any(a.startswith(("--config=", "--config.")) or a == "--config" for a in sys.argv[1:]):
        common.check_config_overrides(sys.argv[1:], "")  # one-line errors for bad paths and keys
    app.run(main, flags_parser=common.parse_flags)
