"""Scores of the name-copy task (flaxformer_lite/data/names.py): did the output copy the span?

Each example's span is recovered from its source and reference (`names.copied_span`). Four
shares of the examples, plus how many were scored:

  span_match           the hypothesis holds the span verbatim, as whole space-separated tokens
                       ("hello Kuroro , hi" holds "Kuroro"; "hello Kuroros" does not);
  exact_match          the hypothesis equals the reference (as training's exact_match);
  unseen_span_match,   the same two shares over the examples whose span has a character of
  unseen_exact_match   `unseen_chars` (by default the ones no training string has); NaN
                       when there are none;
  examples, unseen_examples

Pure Python: decode first, score the strings here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flaxformer_lite.data.names import UNSEEN_CHARS, copied_span, has_tokens


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def copy_scores(
    sources: Sequence[str],
    hypotheses: Sequence[str],
    references: Sequence[str],
    unseen_chars: Iterable[str] = UNSEEN_CHARS,
) -> dict[str, float]:
    """The span and exact-match shares, over all examples and over those with unseen
    characters in their span (see the module doc).

    Raises:
        ValueError: the three sequences differ in length, or a reference does not repeat a
            span of its source.
    """
    if not len(sources) == len(hypotheses) == len(references):
        raise ValueError(
            f"{len(sources)} sources, {len(hypotheses)} hypotheses and {len(references)} "
            "references: score one hypothesis and one reference per source"
        )
    unseen_chars = frozenset(unseen_chars)
    spans, exact, unseen = [], [], []
    for source, hypothesis, reference in zip(sources, hypotheses, references):
        span = copied_span(source, reference)
        spans.append(has_tokens(hypothesis, span))
        exact.append(hypothesis == reference)
        unseen.append(not unseen_chars.isdisjoint(span))
    return {
        "span_match": _share(spans),
        "exact_match": _share(exact),
        "unseen_span_match": _share([s for s, u in zip(spans, unseen) if u]),
        "unseen_exact_match": _share([e for e, u in zip(exact, unseen) if u]),
        "examples": len(sources),
        "unseen_examples": sum(unseen),
    }
