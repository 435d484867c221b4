"""Translation requests in, translations out: the server's logic without HTTP.

`Translator.translate(request)` checks a request (a dict decoded from JSON), tokenizes its
lines as `decode.py` does (same truncation, same empty-line rule), hands one `engine.Job`
per non-empty line to the engine and waits for them; a bad line gets an error of its own,
every other line its n-best list. `RequestError` carries the HTTP status of a request that
cannot be served at all (400 bad fields, 413 too large, 503 busy, 504 timed out).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.data.tokenizer import Vocabularies
from flaxformer_lite.serving import engine as engine_lib
from flaxformer_lite.translate.input_lines import tokenize_lines

FIELDS = {
    "text": "list of source lines (strings)",
    "beam_size": "beams: 1 is greedy (default: the server's --default_beam_size)",
    "nbest": "hypotheses per line, best first (<= beam_size)",
    "alpha": "beam search length-penalty exponent (default 0.6)",
    "max_len": "tokens to generate at most, EOS included",
    "min_len": "tokens before EOS is allowed",
    "strict": "refuse over-long lines (a per-line error) instead of truncating them",
    "stream": "greedy only: server-sent events, tokens as they are decoded",
    "alignment": "also word alignments (Moses i-j pairs) from the last decoder layer's "
    "cross-attention, averaged over heads",
    "constraints": "per line, target phrases each hypothesis must contain (beam search, "
    "decoded outside the continuous batch)",
}


class RequestError(Exception):
    """A request that cannot be served: `status` is its HTTP status."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_lines: int = 256  # lines per request (more: 413)
    max_line_chars: int = 4096  # characters per line (more: a per-line error)
    default_beam_size: int = 4
    timeout: float = 60.0  # seconds a request may wait and run (then 504)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A checked request."""

    lines: list[str]
    beam_size: int
    nbest: int
    alpha: float
    max_len: int
    min_len: int
    strict: bool
    stream: bool
    alignment: bool = False
    constraints: list[list[str]] | None = None


class Translator:
    """A workdir's model behind an `Engine`, with its vocabularies and limits.

    `model` (the protocol's) and `params` serve what the engine does not: alignments (a
    teacher-forced pass over the hypotheses) and constrained beam search.
    """

    def __init__(
        self,
        engine: engine_lib.Engine,
        vocab: Vocabularies,
        run_config: RunConfig,
        limits: Limits = Limits(),
        model=None,
        params=None,
    ):
        self.engine, self.vocab, self.run_config, self.limits = engine, vocab, run_config, limits
        self.model, self.params = model, params

    def check(self, request: Any) -> Settings:
        """The request's settings, or `RequestError` (400/413) naming the problem."""
        if not isinstance(request, dict):
            raise RequestError(400, 'the body must be a JSON object such as {"text": ["..."]}')
        unknown = sorted(set(request) - set(FIELDS))
        if unknown:
            raise RequestError(400, f"unknown field {unknown[0]!r}; known: {', '.join(FIELDS)}")
        lines = request.get("text")
        if isinstance(lines, str):
            lines = [lines]
        if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
            raise RequestError(400, '"text" must be a list of strings (one per source line)')
        if not lines:
            raise RequestError(400, '"text" is empty: send at least one line')
        if len(lines) > self.limits.max_lines:
            raise RequestError(
                413,
                f"{len(lines)} lines exceed the limit of {self.limits.max_lines} per "
                "request; split the request",
            )
        beam = _int(request, "beam_size", self.limits.default_beam_size, 1)
        if beam > self.engine.beam_size:
            raise RequestError(
                400,
                f"beam_size {beam} exceeds this server's limit {self.engine.beam_size} "
                "(serve.py --beam_size)",
            )
        nbest = _int(request, "nbest", 1, 1)
        if nbest > beam:
            raise RequestError(400, f"nbest {nbest} needs beam_size >= {nbest}")
        max_len = _int(request, "max_len", self.engine.max_len, 1)
        if max_len > self.engine.max_len:
            raise RequestError(400, f"max_len {max_len} exceeds the server's {self.engine.max_len}")
        min_len = _int(request, "min_len", 0, 0)
        if min_len >= max_len:
            raise RequestError(400, f"min_len {min_len} must be below max_len {max_len}")
        alpha = request.get("alpha", 0.6)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 10:
            raise RequestError(400, f'"alpha" must be a number in [0, 10], got {alpha!r}')
        flags = {k: request.get(k, False) for k in ("strict", "stream", "alignment")}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise RequestError(400, f'"{k}" must be true or false, got {v!r}')
        if flags["stream"] and (beam > 1 or flags["alignment"]):
            raise RequestError(400, "stream needs greedy decoding without alignment")
        constraints = _constraints(request, len(lines), beam, flags["stream"])
        if (flags["alignment"] or constraints) and self.model is None:
            raise RequestError(400, "this server has no model for alignment or constraints")
        return Settings(
            lines, beam, nbest, float(alpha), max_len, min_len, **flags, constraints=constraints
        )

    def jobs(self, s: Settings, on_tokens: Callable[[int], Callable] | None = None):
        """(per-line errors or None, jobs by line index) of checked settings; `on_tokens(i)`
        gives line i's streaming callback."""
        errors: list[str | None] = [None] * len(s.lines)
        texts = list(s.lines)
        for i, line in enumerate(s.lines):
            errors[i] = _line_error(line, self.limits.max_line_chars)
            if errors[i]:
                texts[i] = ""
        max_source = self.engine.source_len
        sources = tokenize_lines(self.vocab, texts, max_source)
        deadline = time.monotonic() + self.limits.timeout
        jobs = {}
        for i, ids in enumerate(sources.ids):
            if not ids or errors[i]:
                continue
            if s.strict and len(self.vocab.source.encode(texts[i])) + 1 > max_source:
                errors[i] = f"the line is longer than the model's {max_source} source tokens"
                continue
            greedy = s.beam_size == 1
            jobs[i] = engine_lib.Job(
                ids=list(ids),
                width=s.beam_size,
                alpha=0.0 if greedy else s.alpha,
                max_len=s.max_len,
                min_len=s.min_len,
                nbest=s.nbest,
                deadline=deadline,
                on_tokens=on_tokens(i) if on_tokens else None,
            )
        return errors, jobs

    def submit(self, jobs: dict) -> None:
        try:
            self.engine.submit(list(jobs.values()))
        except engine_lib.Busy as e:
            raise RequestError(503, f"busy: {e}; retry later", retry_after=1.0) from None
        if self.engine.error:
            raise RequestError(500, self.engine.error)

    async def translate(self, request: Any) -> dict:
        """The response body of a non-streaming request."""
        s = self.check(request)
        errors, jobs = self.jobs(s)
        if s.constraints:
            results = await asyncio.to_thread(self._constrained, s, jobs)
        else:
            self.submit(jobs)
            results = await wait_all(jobs, self.limits.timeout)
        answers = [self.line(i, errors, results) for i in range(len(s.lines))]
        if s.alignment:
            await asyncio.to_thread(self._align, answers, jobs, results, s.max_len)
        return {"translations": answers}

    def _constrained(self, s: Settings, jobs: dict) -> dict:
        """{line: (n-best ids, scores)} by constrained beam search (`translate/constraints`)."""
        from flaxformer_lite.translate import constraints as constraints_lib
        from flaxformer_lite.translate import runner
        from flaxformer_lite.translate.line_io import InputError

        order = sorted(jobs)
        try:
            search = runner.make_search(
                self.run_config,
                beam_size=s.beam_size,
                alpha=s.alpha,
                max_len=s.max_len,
                min_len=s.min_len,
                nbest=s.nbest,
            )
            phrase_ids = constraints_lib.tokenize_phrases(
                self.vocab.target, [s.constraints[i] for i in order], s.max_len
            )
        except InputError as e:
            raise RequestError(400, str(e)) from None
        result, _ = constraints_lib.decode_lines(
            self.model,
            self.params,
            self.vocab,
            self.run_config,
            [s.lines[i] for i in order],
            phrase_ids,
            search=search,
            nbest=s.nbest,
        )
        return {
            i: (
                [engine_lib.strip_ids(ids) for ids in result.nbest_ids[n]],
                [score for _, score in result.hypotheses[n]],
            )
            for n, i in enumerate(order)
        }

    def _align(self, answers: list, jobs: dict, results: dict, max_len: int) -> None:
        """Adds "alignment" (Moses pairs) to every hypothesis of `answers`."""
        from flaxformer_lite.translate import word_alignment
        from flaxformer_lite.translate.bucketing import Sources

        order = sorted(results)
        sources = Sources(ids=[jobs[i].ids for i in order])
        hyps = [[[*ids, EOS_ID] for ids in results[i][0]] for i in order]
        pairs = word_alignment.align_hypotheses(
            self.model,
            self.params,
            self.vocab.target,
            sources,
            hyps,
            max_source_len=self.engine.source_len,
            target_len=max_len + 1,
            source_vocab=self.vocab.source,
        )
        for i, line_pairs in zip(order, pairs, strict=True):
            for hyp, p in zip(answers[i]["hypotheses"], line_pairs, strict=True):
                hyp["alignment"] = word_alignment.format_pairs(p)

    def line(self, i: int, errors: list, results: dict) -> dict:
        """One line's answer: {"error"} or {"hypotheses": [{"text", "score"}, ...]}."""
        if errors[i]:
            return {"error": errors[i]}
        if i not in results:  # an empty line: nothing decoded
            return {"hypotheses": [{"text": "", "score": 0.0}]}
        tokens, scores = results[i]
        decode = self.vocab.target.decode
        return {
            "hypotheses": [
                {"text": decode(t), "score": round(float(sc), 6)}
                for t, sc in zip(tokens, scores, strict=True)
            ]
        }


async def wait_all(jobs: dict, timeout: float) -> dict:
    """{line: (tokens, scores)} of every job, or RequestError 504 / 500."""
    futures = {i: asyncio.wrap_future(job.future) for i, job in jobs.items()}
    try:
        done = await asyncio.wait_for(asyncio.gather(*futures.values()), timeout + 1.0)
    except (TimeoutError, engine_lib.Expired):
        raise RequestError(504, f"the request took longer than {timeout:g} s") from None
    except RuntimeError as e:
        raise RequestError(500, str(e)) from None
    return dict(zip(futures, done, strict=True))


def _constraints(request: dict, lines: int, beam: int, stream: bool) -> list | None:
    """The "constraints" field checked: one list of phrases (strings) per line, or None."""
    value = request.get("constraints")
    if value is None:
        return None
    shape = '"constraints" must be one list of phrases (strings) per line of "text"'
    if not isinstance(value, list) or len(value) != lines:
        raise RequestError(400, shape)
    if not all(isinstance(p, list) and all(isinstance(x, str) for x in p) for p in value):
        raise RequestError(400, shape)
    if beam < 2 or stream:
        raise RequestError(400, "constraints need beam search: set beam_size >= 2, no stream")
    return value if any(value) else None


def _int(request: dict, name: str, default: int, lowest: int) -> int:
    value = request.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise RequestError(400, f'"{name}" must be an integer >= {lowest}, got {value!r}')
    return value


def _line_error(line: str, max_chars: int) -> str | None:
    """Why a line cannot be translated, or None."""
    if len(line) > max_chars:
        return f"the line has {len(line)} characters, over the limit of {max_chars}"
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return "the line is not valid Unicode text (a lone surrogate); fix its encoding"
    if "\n" in line or "\r" in line:
        return "the line holds a line break; send each line as its own string"
    return None
