"""`decode.py --report`: the exposure-bias report of a workdir on input/reference lines.

The report compares greedy output with the references (`evaluation/
exposure_bias.py`); decoding is the ordinary greedy decoding of the lines,
whose tokens the report reuses, plus forced passes over (source, reference)
pairs batched as `scoring.py` batches them. Lines with an empty source are
neither decoded nor counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.evaluation import exposure_bias, exposure_probe
from flaxformer_lite.models import predict
from flaxformer_lite.translate import bucketing, scoring
from flaxformer_lite.translate.line_io import InputError


def check_options(o) -> None:
    """Refuses flags that contradict --report (a `cli.decode.Options`), in one line."""
    if not o.report:
        return
    if not o.reference:
        raise InputError("--report needs --reference: the lines greedy output is compared with")
    if o.score:
        raise InputError("--report decodes and --score does not: drop one of them")
    given = {
        "--beam_size": o.beam_size > 1,
        "--temperature": o.temperature > 0,
        "--top_k": o.top_k > 0,
        "--top_p": o.top_p != 1.0,
        "--nbest": o.nbest > 1,
        "--min_len": o.min_len > 0,
    }
    contradicting = [flag for flag, bad in given.items() if bad]
    if contradicting:
        raise InputError(
            "--report always decodes greedily (one beam, no sampling, no --min_len): drop "
            + ", ".join(contradicting)
        )


def tokenize_references(
    tokenizer,
    references: Sequence[str],
    run_config: RunConfig,
    *,
    strict: bool = False,
    log: Callable[[str], None] = lambda s: None,
    oov=None,
) -> scoring.Targets:
    """The references as the report's gold targets (before decoding, so --strict fails first);
    `oov` as in `scoring.tokenize_targets`.

    Raises:
      InputError: `strict` and a reference longer than the model's target length.
    """
    max_target_len = run_config.data.max_target_len
    targets = scoring.tokenize_targets(
        tokenizer, references, max_target_len, strict=strict, oov=oov
    )
    if targets.num_truncated:
        log(
            f"warning: {targets.num_truncated} reference line(s) longer than {max_target_len} "
            "target tokens were truncated in the report (--strict refuses them)"
        )
    return targets


def report_lines(
    model,
    params,
    run_config: RunConfig,
    sources: bucketing.Sources,
    targets: scoring.Targets,
    greedy_ids: Sequence[Sequence[int]],
    *,
    search: predict.SearchConfig,
    batch_size: int = 32,
    target_vocab=None,
) -> exposure_bias.Report:
    """The exposure-bias report of decoded lines against their references.

    Args:
      model: a `models.base.Seq2SeqModel`.
      sources: `input_lines.tokenize_lines` of the input lines.
      targets: `tokenize_references` of the reference lines (one per input line).
      greedy_ids: per line, the greedy output ids (`DecodeResult.output_ids`),
        decoded with `search`.
      target_vocab: the target `Tokenizer`: outputs are compared with the
        references as text (`exposure_probe.Probe.for_search`).
    """
    if search.method != "greedy":
        raise InputError("the exposure report compares greedy output: decode with --beam_size 1")
    max_target_len = run_config.data.max_target_len
    probe = exposure_probe.Probe.for_search(model, search, target_vocab)
    source_lengths = [len(ids) for ids in sources.ids]
    rows = bucketing.batch_rows(source_lengths, batch_size)
    batches = scoring.plan_pair_batches(
        source_lengths,
        [len(ids) for ids in targets.ids],
        rows,
        bucketing.bucket_lengths(run_config.data.max_source_len),
        bucketing.bucket_lengths(max_target_len),
    )
    parts = []
    for indices, source_len, target_len in batches:
        batch = {
            "inputs": bucketing.pad_rows(sources.ids, indices, rows, source_len),  # int32[B, S]
            "targets": bucketing.pad_rows(targets.ids, indices, rows, target_len),  # int32[B, T]
        }
        greedy = bucketing.pad_rows(greedy_ids, indices, rows, search.max_len)  # int32[B, L]
        real = np.arange(rows) < len(indices)  # [B]; the other rows are all-PAD filler
        parts.append(probe.arrays(params, batch, greedy).rows(real))
    return probe.report(parts, min_width=max_target_len)
