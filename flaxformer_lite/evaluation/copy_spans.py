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

:func:`verbatim_copies` scores any translation the same way, without spans: of the source
words that the reference repeats verbatim (names, numbers, brand words), the share that the
hypothesis repeats too.

Pure Python: decode first, score the strings here.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

from flaxformer_lite.data.names import UNSEEN_CHARS, copied_span, has_tokens


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def _check_lengths(sources: Sequence[str], hypotheses: Sequence[str], references: Sequence[str]):
    if not len(sources) == len(hypotheses) == len(references):
        raise ValueError(
            f"{len(sources)} sources, {len(hypotheses)} hypotheses and {len(references)} "
            "references: score one hypothesis and one reference per source"
        )


def _is_punctuation(char: str) -> bool:
    return unicodedata.category(char).startswith("P")


def words(text: str) -> set[str]:
    """The distinct words of ``text``: whitespace-separated tokens with leading and trailing
    Unicode punctuation (categories P*) stripped, case kept; tokens that are all punctuation
    are dropped. ``"„Boston-Terrier“, 3."`` -> ``{"Boston-Terrier", "3"}``."""
    out = set()
    for token in text.split():
        start, end = 0, len(token)
        while start < end and _is_punctuation(token[start]):
            start += 1
        while end > start and _is_punctuation(token[end - 1]):
            end -= 1
        if start < end:
            out.add(token[start:end])
    return out


def is_name_like(word: str) -> bool:
    """Whether a word starts with an uppercase letter or a digit (names, numbers, brands)."""
    return word[:1].isupper() or word[:1].isdigit()


def verbatim_copies(
    sources: Sequence[str], hypotheses: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    """How many of the source words that the reference repeats the hypothesis repeats too.

    Per example, the distinct :func:`words` of the source that are also words of the
    reference are *copyable*; a copyable word is *reproduced* when it is also a word of the
    hypothesis (exact, case-sensitive comparison). Summed over the examples:

      copyable, reproduced, share          all such words (share = reproduced / copyable,
                                           NaN when nothing is copyable);
      name_copyable, name_reproduced,      the same restricted to :func:`is_name_like` words,
      name_share                           since shared lowercase words are often
                                           coincidences (en "die" / de "die");
      examples

    Raises:
        ValueError: the three sequences differ in length.
    """
    _check_lengths(sources, hypotheses, references)
    copyable = reproduced = name_copyable = name_reproduced = 0
    for source, hypothesis, reference in zip(sources, hypotheses, references):
        shared = words(source) & words(reference)
        repeated = shared & words(hypothesis)
        copyable += len(shared)
        reproduced += len(repeated)
        name_copyable += sum(map(is_name_like, shared))
        name_reproduced += sum(map(is_name_like, repeated))
    return {
        "copyable": copyable,
        "reproduced": reproduced,
        "share": reproduced / copyable if copyable else float("nan"),
        "name_copyable": name_copyable,
        "name_reproduced": name_reproduced,
        "name_share": name_reproduced / name_copyable if name_copyable else float("nan"),
        "examples": len(sources),
    }


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
    _check_lengths(sources, hypotheses, references)
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
