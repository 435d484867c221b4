"""The collectives of a compiled program, read from its HLO text.

A partitioned program's traffic is what SPMD partitioning inserted: all-gathers
of FSDP-sharded weights, all-reduces and reduce-scatters of gradients, and -
the ones that cost without need - collectives that move activations or a whole
decoding cache. `collectives` lists them from the optimised HLO of a compiled
program (`jax.jit(f).lower(...).compile().as_text()`), each with its result
shape, dtype and size, and whether it runs inside a while-loop (a greedy or beam
search step, a scanned layer stack): a collective there runs once per iteration.

XLA also logs, during partitioning, when it has to replicate a whole array to
change its layout ("Involuntary full rematerialization"). That line goes to
the process's stderr from C++, not through Python; `capture_compile_log`
redirects file descriptor 2 while a program compiles to catch it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections.abc import Iterable, Iterator

# Collective opcodes; an async pair `<op>-start` / `<op>-done` is counted once, at the start.
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

REMAT_WARNING = "Involuntary full rematerialization"

# Bits per element of each HLO primitive type (token and tuples carry no data).
_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}

# A computation header: `%name (params) -> type {` or `ENTRY %name (...) -> ... {`.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
# An instruction: `[ROOT] %name = <type> <opcode>(<operands>)<attributes>`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# Attributes that name other computations: a while's body and condition, a fusion's or an
# async op's `calls`, a reduction's `to_apply`, a conditional's branches.
_CALLED = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_LOOP = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (one entry per array of a tuple-valued one).

    kind: one of `KINDS` (an async `-start` op under its plain name).
    shape, dtype: of the array it produces (for an all-gather the gathered array,
      for a reduce-scatter one device's piece).
    nbytes: the size of that array.
    in_loop: it runs inside a while-loop body or condition (once per iteration).
    computation: the HLO computation holding it; name: its instruction name.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    in_loop: bool
    computation: str
    name: str


def _split_type(text: str) -> tuple[str, str]:
    """(`type`, the rest) of an instruction's right-hand side `<type> <opcode>(...)...`."""
    text = text.lstrip()
    if not text.startswith("("):
        head, _, rest = text.partition(" ")
        return head, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[: i + 1], text[i + 1 :].lstrip()
    return text, ""


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every (dtype, shape) array in an HLO type, tuple elements in order."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype in _BITS or dtype.startswith("f8")
    ]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _BITS.get(dtype, 8) // 8  # float8 types are the ones not listed: 8 bits


def _parse(hlo_text: str):
    """Computations -> their instructions [(name, type, opcode, rest)], and the call edges."""
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    calls: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match and "=" not in line.split("(", 1)[0]:
                current = match.group(1)
                computations[current], calls[current] = [], set()
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rhs = match.groups()
        type_text, rest = _split_type(rhs)
        opcode = rest.split("(", 1)[0].strip()
        computations[current].append((name, type_text, opcode, rest))
        calls[current].update(_CALLED.findall(rest))
        for branches in _BRANCHES.findall(rest):
            calls[current].update(b.strip().lstrip("%") for b in branches.split(","))
        if opcode == "while":
            loop_roots.update(_LOOP.findall(rest))
    return computations, calls, loop_roots


def _reachable(roots: Iterable[str], calls: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(calls.get(name, ()))
    return seen


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a compiled program's HLO text, in program order.

    Args:
      hlo_text: `jax.jit(f).lower(...).compile().as_text()` (after SPMD
        partitioning; the lowered, unpartitioned text has no collectives).
    Returns:
      One `Collective` per array moved: a variadic (tuple-valued) all-reduce gives
      one entry per operand. An async pair counts once, with the shape its
      `-done` produces.
    """
    computations, calls, loop_roots = _parse(hlo_text)
    in_loop = _reachable(loop_roots, calls)
    found: list[Collective] = []
    for computation, instructions in computations.items():
        done_types = {}  # start instruction -> the type its `-done` returns
        for _, type_text, opcode, rest in instructions:
            if opcode.endswith("-done"):
                operand = re.match(r"[\w\-]+\(\s*%?([\w.\-]+)", rest)
                if operand:
                    done_types[operand.group(1)] = type_text
        for name, type_text, opcode, _ in instructions:
            kind = opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            arrays = _arrays(done_types.get(name, type_text))
            if opcode.endswith("-start") and name not in done_types and arrays:
                # An unmatched start: its tuple holds the operand(s) first, the result last.
                arrays = arrays[-1:] if kind != "all-reduce" else arrays
            for dtype, shape in arrays:
                found.append(
                    Collective(
                        kind=kind,
                        shape=shape,
                        dtype=dtype,
                        nbytes=_nbytes(dtype, shape),
                        in_loop=computation in in_loop,
                        computation=computation,
                        name=name,
                    )
                )
    return found


def summary(found: Iterable[Collective], *, in_loop: bool | None = None) -> dict[str, int]:
    """Bytes per collective kind (only those inside / outside loops if `in_loop` is given)."""
    totals: dict[str, int] = {}
    for c in found:
        if in_loop is None or c.in_loop == in_loop:
            totals[c.kind] = totals.get(c.kind, 0) + c.nbytes
    return totals


def format_report(found: Iterable[Collective]) -> str:
    """One line per kind and place (`loop` / `once`): count, total bytes, largest shape."""
    groups: dict[tuple[str, bool], list[Collective]] = {}
    for c in found:
        groups.setdefault((c.kind, c.in_loop), []).append(c)
    lines = []
    for (kind, loop), items in sorted(groups.items()):
        largest = max(items, key=lambda c: c.nbytes)
        lines.append(
            f"{kind:<18} {'loop' if loop else 'once':<4} n={len(items):<4} "
            f"bytes={sum(c.nbytes for c in items):>12,}  largest {largest.dtype}"
            f"{list(largest.shape)}"
        )
    return "\n".join(lines) if lines else "no collectives"


def remat_warnings(log: str) -> list[str]:
    """The lines of a compile log where XLA replicated a whole array to reshard it."""
    return [line for line in log.splitlines() if REMAT_WARNING in line]


@contextlib.contextmanager
def capture_compile_log() -> Iterator[list[str]]:
    """Collects what XLA writes to stderr (file descriptor 2) while the block compiles.

    Yields a list that holds the captured text (one string) once the block ends.
    The persistent compilation cache is off inside the block: a program read
    back from it is not partitioned again, so it would log nothing.

        with capture_compile_log() as log:
            compiled = jax.jit(step).lower(*args).compile()
        assert not remat_warnings(log[0])
    """
    import jax

    captured: list[str] = []
    cache_was_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            jax.config.update("jax_enable_compilation_cache", cache_was_on)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            captured.append(text)
            os.write(2, text.encode())  # the log still reaches the terminal
