"""How far an int8 CTranslate2 model is from ours on THIS machine, and what helps when far.

CTranslate2 multiplies int8 weights with activations quantized at run time as unsigned
8-bit values (u8 x s8). CPUs without VNNI (AVX2-only AMD EPYC, Xeons before Cascade
Lake) do that with `vpmaddubsw`, which adds each pair of u8 x s8 products into a
saturating int16: 2 x 255 x 127 = 64770 > 32767, so large activations against large
weights are clipped, and the log-probabilities can be a nat or more off (seen: 1.16 on
the test model, against 0.07 with VNNI). The same model file is then fine on one CPU and
wrong on another, so the difference is measured where the export runs, in a child
process whose CTranslate2 log names the GEMM backend it picked, and above
`INT8_WARNING` the alternatives are measured too:

* the other GEMM backend (`CT2_USE_MKL=1` or `0`): Intel MKL and oneDNN treat u8 x s8
  differently, and which one is safe depends on the CPU;
* 7-bit weights (`--int8_weight_bits 7`): |w| <= 63 keeps every pair within int16
  (2 x 255 x 63 = 32130) on every CPU, at a coarser weight grid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

import numpy as np

INT8_WARNING = 0.25  # |log p| difference above which an int8 export warns
INT8_QUANTIZATIONS = ("int8", "int8_float32")
WEIGHT_BITS = (8, 7)
_BACKEND_LINES = ("CPU:", "Selected ISA:", "GEMM_S8 backend:")


@dataclasses.dataclass(frozen=True)
class Measured:
    """One way of running the int8 model, and its largest |log p| difference from ours."""

    setting: str  # e.g. "as exported", "CT2_USE_MKL=1", "--int8_weight_bits 7"
    difference: float
    backend: str  # CTranslate2's own words: CPU, selected ISA, int8 GEMM backend

    def line(self) -> str:
        return f"{self.setting}: {self.difference:.3g} ({self.backend})"


def cpu_has_vnni() -> bool | None:
    """Whether the CPU has an int8 dot-product instruction (AVX-512 VNNI or AVX-VNNI);
    None where /proc/cpuinfo cannot tell."""
    try:
        with open("/proc/cpuinfo") as f:
            for row in f:
                if row.startswith("flags"):
                    flags = row.split(":", 1)[1].split()
                    return "avx512_vnni" in flags or "avx_vnni" in flags
    except OSError:
        pass
    return None


def quantize_weights(spec, bits: int) -> None:
    """Quantizes every weight of `spec` that has a `*_scale` to int8 with |q| <= 2**(bits-1)-1.

    Per output row as CTranslate2's own int8 does (scale = qmax / max |w|), so with
    bits=8 the result is CTranslate2's; with bits=7 no pair of products saturates.
    """
    from ctranslate2.specs import model_spec

    qmax = float(2 ** (bits - 1) - 1)

    def quantize(layer, name, value):
        if not isinstance(value, model_spec.Variable) or value.is_scalar():
            return
        key = name.split("/")[-1]
        if not hasattr(layer, f"{key}_scale"):
            return
        w = value.to("float32").numpy()
        flat = w.reshape(w.shape[0], -1)  # [out, in]
        amax = np.abs(flat).max(axis=1)
        amax[amax == 0] = qmax
        scale = (qmax / amax).astype(np.float32)
        q = np.rint(flat * scale[:, None]).astype(np.int8).reshape(w.shape)
        setattr(layer, key, model_spec.NumpyVariable(q))
        setattr(layer, f"{key}_scale", model_spec.NumpyVariable(scale))

    model_spec.visit_spec(spec, quantize)


def backend_summary(ct2_log: str) -> str:
    """The CPU, ISA and int8 GEMM backend from CTranslate2's verbose log, on one line."""
    found = []
    for row in ct2_log.splitlines():
        for key in _BACKEND_LINES:
            if key in row:
                found.append(re.sub(r"\s+", " ", row.split(key, 1)[1]).strip())
    return "; ".join(found) if found else "backend not reported"


def score_in_child(
    model_dir: str,
    source_pieces: Sequence[Sequence[str]],
    target_pieces: Sequence[Sequence[str]],
    env: dict[str, str] | None = None,
) -> tuple[list[np.ndarray], str]:
    """CTranslate2's token log-probs of the pairs, computed in a fresh process.

    CTranslate2 picks its GEMM backend once per process (from `CT2_USE_MKL` and the
    CPU), so each setting needs a process of its own. Returns (per-pair float32 arrays,
    `backend_summary` of the child's log).
    """
    request = {"model": model_dir, "source": list(map(list, source_pieces))}
    request["target"] = list(map(list, target_pieces))
    child_env = {**os.environ, **(env or {}), "CT2_VERBOSE": "1"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flaxformer_lite.export.int8_check", f.name],
            capture_output=True,
            text=True,
            env=child_env,
            timeout=600,
        )
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"scoring the int8 model in a child process failed: {tail[0]}")
    scores = [np.asarray(s, np.float32) for s in json.loads(proc.stdout)]
    return scores, backend_summary(proc.stderr)


def alternatives(
    model_dir: str,
    weight_bits: int,
    rewrite: Callable[[str, int], None],
    measure: Callable[[str, dict | None], Measured],
) -> list[Measured]:
    """Measures what may bring a far int8 model close: the other GEMM backend on the same
    file, and (when the export used 8-bit weights) 7-bit weights written by `rewrite(dir,
    bits)` into a scratch directory."""
    use_mkl = os.environ.get("CT2_USE_MKL")
    flip = "0" if use_mkl == "1" else "1"
    found = [measure(model_dir, {"CT2_USE_MKL": flip})]
    found[0] = dataclasses.replace(found[0], setting=f"CT2_USE_MKL={flip}")
    if weight_bits == 8:
        with tempfile.TemporaryDirectory(prefix=".int8-7bit-") as scratch:
            rewrite(scratch, 7)
            seven = measure(scratch, None)
        found.append(dataclasses.replace(seven, setting="--int8_weight_bits 7"))
    return found


def warning(measured: Measured, tried: list[Measured]) -> str:
    """One line: how far the model is, why, and what was measured to help."""
    vnni = cpu_has_vnni()
    why = (
        "this CPU has no VNNI, so CTranslate2's u8 x s8 int8 products can saturate"
        if vnni is False
        else "CTranslate2's int8 GEMM on this CPU"
    )
    helps = [t for t in tried if t.difference <= INT8_WARNING]
    advice = (
        "what helps here: " + ", ".join(f"{t.setting} ({t.difference:.3g})" for t in helps)
        if helps
        else "nothing tried helped ("
        + ", ".join(f"{t.setting} {t.difference:.3g}" for t in tried)
        + "); use float32 or int16"
    )
    return (
        f"warning: the int8 model's log-probabilities differ from ours by "
        f"{measured.difference:.3g} (> {INT8_WARNING:g}) on this machine ({why}); {advice}"
    )


def _child(request_path: str) -> None:
    import ctranslate2

    with open(request_path) as f:
        request = json.load(f)
    translator = ctranslate2.Translator(request["model"], device="cpu")
    results = translator.score_batch(request["source"], request["target"])
    json.dump([list(map(float, r.log_probs)) for r in results], sys.stdout)


if __name__ == "__main__":
    _child(sys.argv[1])
