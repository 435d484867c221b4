"""A generated, download-free copy task: a turn that introduces a name or a code, answered by
a reply that repeats it verbatim in another position and another sentence form.

    source "hi , i am Kuroro"                target "hello Kuroro , nice to meet you"
    source "my code is XK-4471 ."            target "thank you , XK-4471 is noted"
    source "call me Anla Berinok"            target "nice to meet you , Anla Berinok"

The copied span is a one-word name, a two-word name (capitalised syllable combinations) or a
code (two or three capital letters, a hyphen, three or four digits). Each source template has
its own reply template (:data:`NAME_TEMPLATES`, :data:`CODE_TEMPLATES`), so the reply is a
function of the source and exact match can reach 1. Templates are lowercase ASCII words and
punctuation, a vocabulary of a few dozen words; the spans carry the rest.

What the held-out splits test is copying, not memory:

* no word of a validation or test span is a word of any training span;
* half of the validation and of the test spans (rounded down) hold at least one character of
  :data:`UNSEEN_CHARS`, which occurs nowhere in the training split, neither side: a
  SentencePiece vocabulary trained on it maps those characters to the unknown piece, so only a
  model that copies source positions (a pointer-generator head) can write them.

The examples depend only on the seed and the split sizes: each split draws from its own
``random.Random`` stream, and a held-out split also depends on the training spans it avoids.
:func:`generate_names` returns the examples with their spans; :func:`load_names` the splits as
the other loaders give them (lists of ``{"source": bytes, "target": bytes}``, small enough to
generate in memory on each run); :func:`copied_span` recovers a span from a source and a target.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from flaxformer_lite.data.examples import SOURCE_FIELD, SPLITS, TARGET_FIELD, as_str

# (source, reply) template pairs; "{}" is the span.
NAME_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("hi , i am {}", "hello {} , nice to meet you"),
    ("call me {}", "nice to meet you , {}"),
    ("my name is {} , hello", "welcome , {} !"),
    ("{} here , hello", "hi {} , how are you ?"),
    ("hello , this is {} speaking", "{} , good to hear from you"),
    ("people call me {} at home", "then i will call you {} too"),
)
CODE_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("my code is {} .", "thank you , {} is noted"),
    ("{} is my code", "code {} is accepted"),
    ("please use the code {} for me", "ok , i saved {} for you"),
    ("here is my code : {}", "{} , got it"),
)
# Every word of every template: a span token is any token not among them.
TEMPLATE_WORDS: frozenset[str] = frozenset(
    word
    for pair in NAME_TEMPLATES + CODE_TEMPLATES
    for template in pair
    for word in template.split()
    if word != "{}"
)

# Characters of held-out spans only (lowercase ones replace a lowercase letter of a name,
# uppercase ones a capital of a name or a code).
UNSEEN_LOWER = "žøåñłðþßç"
UNSEEN_UPPER = "ŽØÅÑ"
UNSEEN_CHARS: frozenset[str] = frozenset(UNSEEN_LOWER + UNSEEN_UPPER)

_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "j", "")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "", "n", "r", "l", "s", "k")
_CAPITALS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# Span kinds and their shares: one-word name, two-word name, code.
_KINDS = (("name", 0.35), ("full_name", 0.35), ("code", 0.30))

# Draws of a held-out span before giving up (with 20,000 training examples, about one ASCII
# draw in 15 shares a word with the training spans and is redrawn).
_MAX_DRAWS = 1000

DEFAULT_SIZES = {"train": 20_000, "validation": 500, "test": 1_000}


class NameExample(NamedTuple):
    source: str
    target: str
    span: str  # the name or code that the target copies from the source


def _word(rng: random.Random, low: int, high: int) -> str:
    syllables = rng.randint(low, high)
    word = "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )
    return word.capitalize()


def _code(rng: random.Random) -> str:
    letters = "".join(rng.choice(_CAPITALS) for _ in range(rng.randint(2, 3)))
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 4)))
    return f"{letters}-{digits}"


def _ascii_span(rng: random.Random, kind: str) -> str:
    if kind == "name":
        return _word(rng, 2, 3)
    if kind == "full_name":
        # Two-syllable first names: of one syllable there are too few (about 500) for
        # held-out names to avoid the training ones.
        return f"{_word(rng, 2, 2)} {_word(rng, 2, 3)}"
    return _code(rng)


def _with_unseen(rng: random.Random, span: str) -> str:
    """``span`` with one or two of its letters replaced by characters of UNSEEN_CHARS."""
    letters = [i for i, c in enumerate(span) if c.isalpha()]
    chars = list(span)
    for i in rng.sample(letters, min(len(letters), rng.randint(1, 2))):
        chars[i] = rng.choice(UNSEEN_UPPER if chars[i].isupper() else UNSEEN_LOWER)
    return "".join(chars)


def _example(rng: random.Random, span: str, kind: str) -> NameExample:
    source, reply = rng.choice(CODE_TEMPLATES if kind == "code" else NAME_TEMPLATES)
    return NameExample(source.format(span), reply.format(span), span)


def _kind(rng: random.Random) -> str:
    return rng.choices([k for k, _ in _KINDS], weights=[w for _, w in _KINDS])[0]


def _check_sizes(sizes: Mapping[str, int]) -> None:
    for split, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"the {split} size must be a non-negative integer, got {n!r}")
    if sizes["train"] < 1:
        raise ValueError("the train split needs at least one example")


def generate_names(
    num_train: int = DEFAULT_SIZES["train"],
    num_valid: int = DEFAULT_SIZES["validation"],
    num_test: int = DEFAULT_SIZES["test"],
    seed: int = 0,
) -> dict[str, list[NameExample]]:
    """The examples of every split, with their copied spans.

    Returns:
        ``{"train": [...], "validation": [...], "test": [...]}`` of :class:`NameExample`.
        Training spans are ASCII; held-out spans share no word with any training span, and
        ``n // 2`` of a held-out split's ``n`` spans, at shuffled positions, hold a character
        of :data:`UNSEEN_CHARS`.
    """
    sizes = {"train": num_train, "validation": num_valid, "test": num_test}
    _check_sizes(sizes)
    rng = random.Random(f"names/{seed}/train")
    train = []
    for _ in range(num_train):
        kind = _kind(rng)
        train.append(_example(rng, _ascii_span(rng, kind), kind))
    seen = {word for example in train for word in example.span.split()}
    out = {"train": train}
    for split in SPLITS[1:]:
        rng = random.Random(f"names/{seed}/{split}")
        n = sizes[split]
        unseen = [True] * (n // 2) + [False] * (n - n // 2)
        rng.shuffle(unseen)
        examples = []
        for with_unseen in unseen:
            kind = _kind(rng)
            for _ in range(_MAX_DRAWS):
                span = _ascii_span(rng, kind)
                if with_unseen:
                    span = _with_unseen(rng, span)
                if seen.isdisjoint(span.split()):
                    break
            else:
                raise ValueError(
                    f"no {kind} span unseen in training after {_MAX_DRAWS} draws: the "
                    f"{num_train} training examples use up nearly all of them"
                )
            examples.append(_example(rng, span, kind))
        out[split] = examples
    return out


def load_names(
    num_train: int = DEFAULT_SIZES["train"],
    num_valid: int = DEFAULT_SIZES["validation"],
    num_test: int = DEFAULT_SIZES["test"],
    seed: int = 0,
) -> dict[str, list[dict[str, bytes]]]:
    """The splits of :func:`generate_names` as ``{"source": bytes, "target": bytes}`` (UTF-8)
    lists, the random-access sources the data pipeline reads; the spans are left out (recover
    them with :func:`copied_spans`)."""
    return {
        split: [
            {SOURCE_FIELD: e.source.encode("utf-8"), TARGET_FIELD: e.target.encode("utf-8")}
            for e in examples
        ]
        for split, examples in generate_names(num_train, num_valid, num_test, seed).items()
    }


def copied_span(source: str, target: str) -> str:
    """The span that ``target`` copies from ``source``: the run of source tokens that are no
    template words.

    Raises:
        ValueError: the source has no such run, or several, or the target lacks it.
    """
    tokens = source.split()
    inside = [i for i, token in enumerate(tokens) if token not in TEMPLATE_WORDS]
    if not inside or inside[-1] - inside[0] + 1 != len(inside):
        raise ValueError(f"no single span of non-template words in {source!r}")
    span = tokens[inside[0] : inside[-1] + 1]
    if not has_tokens(target, span):
        raise ValueError(f"target {target!r} does not repeat the span {' '.join(span)!r}")
    return " ".join(span)


def has_tokens(text: str, span: str | Sequence[str]) -> bool:
    """Whether ``text`` holds ``span`` verbatim as whole space-separated tokens."""
    tokens, want = text.split(), span.split() if isinstance(span, str) else list(span)
    n = len(want)
    return n > 0 and any(tokens[i : i + n] == want for i in range(len(tokens) - n + 1))


def copied_spans(split: Sequence[Mapping[str, Any]]) -> list[str]:
    """:func:`copied_span` of every ``{"source", "target"}`` example of a split, in order."""
    return [copied_span(as_str(e[SOURCE_FIELD]), as_str(e[TARGET_FIELD])) for e in split]
