"""Decode text with a trained workdir: one output line per input line, in order.

python decode.py --workdir workdirs/default --input in.txt --output out.txt --beam_size 4
echo "de 4721" | python decode.py --workdir workdirs/default --beam_size 1
python decode.py --workdir workdirs/default --input in.txt --reference ref.txt
python decode.py --workdir workdirs/default --input in.txt --nbest 3 --attention_png plots/
python decode.py --workdir workdirs/default --input in.txt --reference ref.txt --score
python decode.py --workdir workdirs/default --input in.txt --reference ref.txt --report
python decode.py --workdir workdirs/nat --input in.txt --iterations 10 --length_beam 3
python decode.py --workdir workdirs/speech --input wavs.txt --reference words.txt  # + WER
python decode.py --workdir workdirs/default --input in.txt --format jsonl --nbest 2 --alignment
python decode.py --workdir workdirs/default --interactive --beam_size 1  # answers line by line
python decode.py --workdir workdirs/default --input in.txt --constraints terms.txt  # must contain
"""

import sys

from absl import app, flags, logging
from absl.flags import DEFINE_bool, DEFINE_enum, DEFINE_float, DEFINE_integer, DEFINE_string

from flaxformer_lite.cli import common, compilation_cache

FLAGS = flags.FLAGS


SCORE_HELP = (
    "Forced decoding of --reference instead of search: one line per input, the log-probability "
    "of its reference line (the sum over its target tokens, EOS included). An empty reference "
    "scores EOS alone; an empty source gives an empty line (nothing is decoded)."
)


REPORT_HELP = (
    "With --reference: decode greedily (--beam_size defaults to 1) and print the exposure-bias "
    "report to stderr: teacher-forced vs free-running accuracy, first errors, prefix swaps, "
    "exact match by length."
)


NAT_HELP = "Non-autoregressive workdirs: "


FORMAT_HELP = (
    "text: one line per input line (with --nbest: hyp<TAB>score<TAB>...). jsonl: one JSON "
    'object per input line, in order: {"line": its 1-based number, "source": the line, '
    '"hypotheses": [{"text", "score", "tokens": the generated pieces}, ...]}, --nbest of them '
    'best first; a blank line gives "hypotheses": []. The score is what the search ranks by: '
    "beam search's length-normalised log-probability, Mask-Predict's mean token "
    "log-probability; greedy decoding and sampling track none: null."
)


ALIGNMENT_HELP = (
    "Word alignments, Moses-style 'i-j' pairs (source word i, target word j, 0-based): the "
    "cross-attention of decoder layer --alignment_layer, averaged over its heads, in a "
    "teacher-forced pass over the source and each hypothesis; every target piece links to "
    "the source piece it attends to most (EOS and padding left out), pieces grouped into "
    "words at '▁'. text: a tab and the pairs after each hypothesis; jsonl: an "
    '"alignment" list of [i, j] per hypothesis.'
)


INTERACTIVE_HELP = (
    "Answer each input line as soon as it is read, flushing stdout (for a program that writes "
    "a line and waits for its answer); the default when stdin is a terminal. One output line "
    "per input line; a refused line (over-long under --strict) gets an empty line or a JSON "
    '"error". Refuses --output, --reference, --score, --report and --attention_png.'
)


CONSTRAINTS_HELP = (
    "File of target phrases every output must contain (terminology): one line per input "
    "line, that line's phrases separated by tabs, an empty line for none. Lexically "
    "constrained beam search (Dynamic Beam Allocation) with --beam_size beams; a phrase "
    "matches where a target word starts. A line no hypothesis satisfies within --max_len "
    "tokens is decoded without constraints, with a warning. Autoregressive workdirs only."
)


def define_flags() -> None:
    DEFINE_string("workdir", None, "Training workdir written by train.py.", required=True)
    DEFINE_string("step", "latest", "latest (default), latest-good, best, or a step number.")
    DEFINE_integer("average", 1, "Mean params of the last N checkpoints to --step.", lower_bound=1)
    DEFINE_string(
        "input",
        None,
        "Input text, one source per line (default: stdin); for a speech workdir (one trained "
        "on spoken_numbers), one 16-bit PCM mono WAV file path per line.",
    )
    DEFINE_string("output", None, "Output file, written atomically (default: stdout).")
    DEFINE_integer("beam_size", 4, "Beams; 1 with --temperature 0 is greedy.", lower_bound=1)
    DEFINE_float("alpha", 0.6, "Beam-search length-penalty exponent.", lower_bound=0.0)
    DEFINE_float("temperature", 0.0, "0: greedy or beam; > 0: sampling.", lower_bound=0.0)
    DEFINE_integer("top_k", 0, "Sampling: keep the k likeliest tokens (0: all).", lower_bound=0)
    DEFINE_float("top_p", 1.0, "Sampling: nucleus probability mass (1: all).")
    DEFINE_integer("max_len", None, "Tokens to generate (default: data.max_target_len).")
    DEFINE_integer("min_len", 0, "EOS is forbidden before this many tokens.", lower_bound=0)
    DEFINE_integer("nbest", 1, "Hypotheses per line (tab-separated with scores).", lower_bound=1)
    DEFINE_integer("seed", 0, "Sampling seed.")
    DEFINE_integer("batch_size", 32, "Sentences per model call.", lower_bound=1)
    _define_mode_flags()


def _define_mode_flags() -> None:
    """How lines are batched, what is reported besides the translations (references,
    scores, plots, alignments, formats), the non-autoregressive and interactive modes."""
    DEFINE_enum(
        "batching",
        "padded",
        ["padded", "continuous"],
        "padded: batches of similar length, each run until its last sentence ends. "
        "continuous: --batch_size slots, a slot refilled as soon as its sentence ends (the "
        "server's engine; greedy or beam search of autoregressive text models).",
    )
    DEFINE_bool("strict", False, "Refuse lines longer than the model's source/target length.")
    DEFINE_string("reference", None, "Reference lines: BLEU and chrF, or with --score the targets.")
    DEFINE_string(
        "bleu_lang",
        None,
        "With --reference: the language whose Moses rules tokenize both sides for the "
        "tokenized BLEU4 (the figure Multi30k papers publish) printed after sacreBLEU's "
        "(default: the run config's data.target_lang, else en).",
    )
    DEFINE_bool("bleu_lowercase", True, "With --reference: lowercase before the tokenized BLEU4.")
    DEFINE_string("attention_png", None, "Directory for cross-attention plots.")
    DEFINE_integer("attention_count", 4, "Inputs to plot.", lower_bound=0)
    DEFINE_integer("attention_layer", -1, "Decoder layer to plot (negative: from the end).")
    DEFINE_bool("score", False, SCORE_HELP)
    DEFINE_bool("score_tokens", False, "With --score: also each token's log-prob, tab-separated.")
    DEFINE_bool("report", False, REPORT_HELP)
    DEFINE_integer(
        "iterations",
        None,
        NAT_HELP + "Mask-Predict decoder calls (1: one pass; default: the run's nat.iterations).",
        lower_bound=1,
    )
    DEFINE_integer(
        "length_beam",
        None,
        NAT_HELP + "Length candidates decoded in parallel, the "
        "best by mean log-probability first (default: nat.length_beam).",
        lower_bound=1,
    )
    DEFINE_float(
        "length_scale",
        None,
        NAT_HELP + "Multiplies predicted lengths: 0.5 shorter, 2 longer (default 1).",
    )
    DEFINE_enum("format", "text", ["text", "jsonl"], FORMAT_HELP)
    DEFINE_bool("alignment", False, ALIGNMENT_HELP)
    DEFINE_integer(
        "alignment_layer", -1, "Decoder layer whose cross-attention --alignment reads (-1: last)."
    )
    DEFINE_bool("interactive", False, INTERACTIVE_HELP)
    DEFINE_string("constraints", None, CONSTRAINTS_HELP)


@common.friendly_errors
def main(argv):
    if len(argv) > 1:
        common.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax is chatty at INFO/WARNING
    from flaxformer_lite.cli import decode as decode_cli
    from flaxformer_lite.translate import line_io

    compilation_cache.enable(FLAGS.compilation_cache_dir)

    values = {name: FLAGS[name].value for name in decode_cli.Options.names()}
    if FLAGS.report and not FLAGS["beam_size"].present:
        values["beam_size"] = 1  # the report decodes greedily
    try:
        decode_cli.run(decode_cli.Options(**values), on_inputs_checked=common.report_platform)
    except line_io.InputError as e:
        common.fail(str(e))


if __name__ == "__main__":
    common.set_host_malloc(sys.argv[1:])  # before anything starts JAX's threads
    define_flags()
    common.define_host_malloc_flag()
    compilation_cache.define_flag()
    app.run(main, flags_parser=common.parse_flags)
