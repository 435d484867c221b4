"""`decode.py --batching continuous`: a file's lines through the slot engine of the server.

Where `runner.decode_lines` pads batches of similar length and runs each until its last
sentence ends, the engine (`serving/engine.py`) keeps `slots` sentences on the device and
refills a slot as soon as its sentence ends, encoding the newcomers alone; the beams of a
sentence share its cross-attention keys/values. The search is the same (greedy, or beam
search with the GNMT length penalty), and so are the outputs up to float rounding: the
results table in docs/results.md counts the identical lines.

Autoregressive workdirs with a plain softmax output and text input only; `unsupported`
says why another one is refused.
"""

from __future__ import annotations

import time

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies
from flaxformer_lite.serving import engine as engine_lib
from flaxformer_lite.translate import runner
from flaxformer_lite.translate.bucketing import Sources

_ENGINES: dict = {}  # one engine per (model, parameters, shape): compiled once per process


def unsupported(run_config: RunConfig, search) -> str | None:
    """Why continuous batching cannot decode this workdir with this search, or None."""
    if run_config.nat is not None or run_config.copy is not None:
        return "it decodes autoregressive models with a plain softmax output"
    if run_config.model.input_features:
        return "it decodes text input, not speech features"
    if getattr(search, "method", None) not in ("greedy", "beam"):
        return "it runs greedy or beam search, not sampling"
    return None


def engine_for(
    model,
    params,
    run_config: RunConfig,
    beam_size: int,
    max_len: int,
    slots: int,
    steps_per_sync: int,
) -> engine_lib.Engine:
    """The started engine of these settings (made, and compiled on first use, once)."""
    key = (model, id(params), beam_size, max_len, slots, steps_per_sync)
    if key not in _ENGINES or _ENGINES[key][0] is not params:  # an id reused after a free
        engine = engine_lib.Engine(
            model.module,
            engine_lib.params_on_device(params),
            slots=slots,
            beam_size=max(beam_size, 1),
            source_len=run_config.data.max_source_len,
            max_len=max_len,
            steps_per_sync=steps_per_sync,
            max_queue=1 << 30,
        )
        _ENGINES[key] = (params, engine.start())
    return _ENGINES[key][1]


def decode_lines(
    model,
    params,
    tokenizer: Tokenizer | Vocabularies,
    run_config: RunConfig,
    sources: Sources,
    *,
    search,
    nbest: int = 1,
    slots: int = 32,
    steps_per_sync: int = 4,
) -> runner.DecodeResult:
    """`runner.decode_lines`'s result for `sources` (one entry per line, blank lines not
    decoded), by continuous batching in `slots` slots."""
    beam = search.beam_size if search.method == "beam" else 1
    engine = engine_for(model, params, run_config, beam, search.max_len, slots, steps_per_sync)
    start = time.perf_counter()
    jobs = {
        i: engine_lib.Job(
            ids=list(ids),
            width=beam,
            alpha=search.alpha if beam > 1 else 0.0,
            max_len=search.max_len,
            min_len=search.min_len,
            nbest=nbest,
        )
        for i, ids in enumerate(sources.ids)
        if len(ids)
    }
    engine.submit(list(jobs.values()))
    n = len(sources.ids)
    result = runner.DecodeResult([[] for _ in range(n)], [[] for _ in range(n)], sources, set())
    result.nbest_ids = [[] for _ in range(n)]
    detokenize = sources.detokenizer(Vocabularies.of(tokenizer).target)
    for i, job in jobs.items():
        tokens, scores = job.future.result()
        # A hypothesis shorter than max_len ended with EOS (as `runner` keeps it).
        ids = [t + [EOS_ID] if len(t) < search.max_len else t for t in tokens]
        result.hypotheses[i] = [
            (detokenize(t, i), float(s)) for t, s in zip(ids, scores, strict=True)
        ]
        result.nbest_ids[i] = ids
        result.output_ids[i] = ids[0]
        result.num_output_tokens += len(ids[0])
    result.seconds = time.perf_counter() - start
    return result
