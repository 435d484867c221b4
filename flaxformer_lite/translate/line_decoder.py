"""Lines in, records out: a restored model with its decoding settings.

The one entry point for decoding text lines into `records.DecodedLine`s, so that
`decode.py` (a whole file, or interactively one line at a time) and a server
answer a line the same way: `runner.decode_lines` decodes in length buckets (or
`continuous.decode_lines` in the slots of the server's engine),
`word_alignment.align_hypotheses` adds word alignments when asked for, and
`records.decoded_lines` builds one record per line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies
from flaxformer_lite.translate import continuous, input_lines, records, runner, word_alignment
from flaxformer_lite.translate.bucketing import Sources
from flaxformer_lite.translate.line_io import InputError


@dataclasses.dataclass(frozen=True)
class LineDecoder:
    """A model, its parameters and the decoding settings (see `decode.py`'s flags)."""

    model: Any  # a models.base.Seq2SeqModel
    params: Any
    tokenizer: Tokenizer | Vocabularies
    run_config: RunConfig
    search: Any  # runner.make_search's SearchConfig or runner.make_nat_search's NATSearch
    nbest: int = 1
    batch_size: int = 32
    seed: int = 0
    strict: bool = False
    alignment_layer: int | None = None  # decoder layer of the alignments (None: none)
    batching: str = "padded"  # or "continuous": the server's slot engine (`continuous.py`)

    def __post_init__(self) -> None:
        if self.alignment_layer is not None:
            check_alignment(self.run_config, self.alignment_layer)
        if self.batching == "continuous":
            why = continuous.unsupported(self.run_config, self.search)
            if why:
                raise InputError(f"--batching continuous does not apply here: {why}")

    @property
    def scored(self) -> bool:
        """Whether the search ranks by a score: beam search (length-normalised log-prob)
        and Mask-Predict (mean token log-prob) do; greedy and sampling track none."""
        return getattr(self.search, "method", None) not in ("greedy", "sample")

    def decode(
        self,
        lines: Sequence[str],
        *,
        sources: Sources | None = None,
        first_number: int = 1,
        progress: bool | None = False,
    ) -> tuple[list[records.DecodedLine], runner.DecodeResult]:
        """Decodes `lines`: one record per line, in order, blank lines without a model call.

        Args:
          sources: the lines already made into sources (`input_lines.sources_of_lines`).
          first_number: the 1-based number of `lines[0]`, for records and error messages.
          progress: a tqdm bar on stderr (None: on a terminal only).
        Returns:
          (the records, the `runner.DecodeResult` behind them).
        Raises:
          InputError: `strict` and an over-long line; a speech workdir's bad WAV path.
        """
        if sources is None:
            sources = input_lines.sources_of_lines(
                self.tokenizer,
                lines,
                self.run_config,
                strict=self.strict,
                first_number=first_number,
            )
        result = self._search(sources, progress)
        out = records.decoded_lines(
            result,
            lines,
            Vocabularies.of(self.tokenizer).target,
            scored=self.scored,
            alignments=self._align(sources, result),
            first_number=first_number,
        )
        return out, result

    def _search(self, sources: Sources, progress: bool | None) -> runner.DecodeResult:
        """The search over every line: padded batches, or the server's slots."""
        if self.batching == "continuous":
            return continuous.decode_lines(
                *(self.model, self.params, self.tokenizer, self.run_config, sources),
                search=self.search,
                nbest=self.nbest,
                slots=self.batch_size,
            )
        return runner.decode_lines(
            *(self.model, self.params, self.tokenizer, self.run_config, sources),
            search=self.search,
            batch_size=self.batch_size,
            nbest=self.nbest,
            seed=self.seed,
            progress=progress,
        )

    def _align(self, sources: Sources, result: runner.DecodeResult):
        """Every hypothesis's word pairs, or None when no alignment was asked for."""
        if self.alignment_layer is None:
            return None
        vocab = Vocabularies.of(self.tokenizer)
        return word_alignment.align_hypotheses(
            *(self.model, self.params, vocab.target, sources, result.nbest_ids),
            layer=self.alignment_layer,
            max_source_len=self.run_config.data.max_source_len,
            target_len=self.search.max_len,
            source_vocab=vocab.source,
            batch_size=self.batch_size,
        )


def check_alignment(run_config: RunConfig, layer: int) -> None:
    """Raises InputError unless a workdir can align words through decoder layer `layer`:
    its source must be text (a speech workdir's encoder positions are frames, not words)."""
    if input_lines.is_speech(run_config):
        raise InputError(
            "--alignment links source and target words; a speech workdir's source is audio "
            "frames: drop --alignment (--attention_png plots its cross-attention)"
        )
    word_alignment.check_layer(layer, run_config.model.num_decoder_layers)
