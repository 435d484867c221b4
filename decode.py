"""Decode text with a trained workdir: one output line per input line, in order.

python decode.py --workdir workdirs/default --input in.txt --output out.txt --beam_size 4
echo "de 4721" | python decode.py --workdir workdirs/default --beam_size 1
python decode.py --workdir workdirs/default --input in.txt --reference ref.txt
python decode.py --workdir workdirs/default --input in.txt --nbest 3 --attention_png plots/
"""

import os
import sys

from absl import app, flags, logging

from flaxformer_lite.tools import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "Training workdir written by train.py.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the latest).")
    flags.DEFINE_integer(
        "average",
        1,
        "Decode with the mean parameters of the last N checkpoints up to --step.",
        lower_bound=1,
    )
    flags.DEFINE_string("input", None, "Input text, one source per line (default: stdin).")
    flags.DEFINE_string("output", None, "Output file, written atomically (default: stdout).")
    flags.DEFINE_integer("beam_size", 4, "Beams; 1 with --temperature 0 is greedy.", lower_bound=1)
    flags.DEFINE_float("alpha", 0.6, "Beam-search length-penalty exponent.", lower_bound=0.0)
    flags.DEFINE_float(
        "temperature", 0.0, "0: greedy or beam search; > 0: sampling.", lower_bound=0.0
    )
    flags.DEFINE_integer(
        "top_k", 0, "Sampling: keep the k most likely tokens (0: all).", lower_bound=0
    )
    flags.DEFINE_float("top_p", 1.0, "Sampling: nucleus probability mass (1: all).")
    flags.DEFINE_integer("max_len", None, "Tokens to generate (default: data.max_target_len).")
    flags.DEFINE_integer("min_len", 0, "EOS is forbidden before this many tokens.", lower_bound=0)
    flags.DEFINE_integer(
        "nbest", 1, "Hypotheses per line (tab-separated with scores).", lower_bound=1
    )
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("batch_size", 32, "Sentences per model call.", lower_bound=1)
    flags.DEFINE_bool("strict", False, "Refuse lines longer than the model's source length.")
    flags.DEFINE_string("reference", None, "Reference file: print sacreBLEU BLEU and chrF.")
    flags.DEFINE_string("attention_png", None, "Directory for cross-attention plots.")
    flags.DEFINE_integer("attention_count", 4, "Inputs to plot.", lower_bound=0)
    flags.DEFINE_integer("attention_layer", -1, "Decoder layer to plot (negative: from the end).")


def _check_paths() -> None:
    for name in ("input", "reference"):
        path = FLAGS[name].value
        if path not in (None, "-") and not os.path.isfile(path):
            cli.fail(f"--{name}: file {path!r} does not exist")
    out = FLAGS.output
    if out not in (None, "-"):
        if os.path.isdir(out):
            cli.fail(f"--output: {out!r} is a directory; pass a file path")
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            cli.fail(f"--output: directory {parent!r} does not exist")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def input_warnings(num_invalid_utf8: int, sources, max_source_len: int) -> list[str]:
    """One line per kind of bad input, with its count of lines."""
    out = []
    if num_invalid_utf8:
        out.append(f"warning: {num_invalid_utf8} line(s) had invalid UTF-8, replaced by U+FFFD")
    if sources.num_truncated:
        out.append(
            f"warning: {sources.num_truncated} line(s) longer than {max_source_len} source "
            "tokens were truncated (--strict refuses them)"
        )
    if sources.num_unknown:
        out.append(
            f"warning: {sources.num_unknown} line(s) contain characters unknown to the "
            "vocabulary (decoded as <unk>)"
        )
    return out


def summary(result) -> str:
    """Lines decoded, speed, and the number of batch shapes (compilations)."""
    lines, empty = len(result.hypotheses), result.sources.num_empty
    seconds = max(result.seconds, 1e-9)
    return (
        f"decoded {lines - empty} of {lines} line(s) ({empty} empty) in {result.seconds:.1f}s: "
        f"{(lines - empty) / seconds:.1f} sentences/s, "
        f"{result.num_output_tokens / seconds:.0f} tokens/s, "
        f"{len(result.batch_shapes)} batch shape(s)"
    )


@cli.friendly_errors
def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax is chatty at INFO/WARNING
    _check_paths()
    from flaxformer_lite.training import loop
    from flaxformer_lite.translate import runner

    try:
        run_config, tokenizer = runner.open_workdir(FLAGS.workdir, FLAGS.step)
        search = runner.make_search(
            run_config,
            beam_size=FLAGS.beam_size,
            alpha=FLAGS.alpha,
            temperature=FLAGS.temperature,
            top_k=FLAGS.top_k,
            top_p=FLAGS.top_p,
            max_len=FLAGS.max_len,
            min_len=FLAGS.min_len,
            nbest=FLAGS.nbest,
        )
        if FLAGS.attention_png:
            num_layers = run_config["model"]["num_decoder_layers"]
            runner.check_attention_layer(FLAGS.attention_layer, num_layers)
        lines, num_invalid = runner.read_lines(FLAGS.input)
        references = None
        if FLAGS.reference:
            references, _ = runner.read_lines(FLAGS.reference)
            runner.check_line_counts(len(lines), len(references))
        if not lines:
            runner.write_lines(FLAGS.output, [])
            log("input is empty: nothing to decode")
            return
        max_source_len = run_config["data"]["max_source_len"]
        sources = runner.tokenize_lines(tokenizer, lines, max_source_len, strict=FLAGS.strict)
        for warning in input_warnings(num_invalid, sources, max_source_len):
            log(warning)

        model, state, _, _ = loop.restore_trained(FLAGS.workdir, FLAGS.step, average=FLAGS.average)
        result = runner.decode_lines(
            model,
            state.params,
            tokenizer,
            run_config,
            sources,
            search=search,
            batch_size=FLAGS.batch_size,
            nbest=FLAGS.nbest,
            seed=FLAGS.seed,
            progress=None,  # a bar only on a terminal
        )
        runner.write_lines(
            FLAGS.output, [runner.format_line(h, FLAGS.nbest) for h in result.hypotheses]
        )
        log(summary(result))
        if references is not None:
            log(runner.bleu_report(result.texts, references))
        if FLAGS.attention_png and FLAGS.attention_count:
            paths = runner.save_attention_pngs(
                model,
                state.params,
                tokenizer,
                sources.ids,
                result.output_ids,
                FLAGS.attention_png,
                layer=FLAGS.attention_layer,
                count=FLAGS.attention_count,
            )
            log(f"wrote {len(paths)} attention plot(s) to {FLAGS.attention_png}")
    except runner.InputError as e:
        cli.fail(str(e))


if __name__ == "__main__":
    cli.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    define_flags()
    cli.define_host_malloc_flag()
    app.run(main, flags_parser=cli.parse_flags)
