"""What `serve.py` does with its flag values: load a workdir, start the engine, serve HTTP."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
from collections.abc import Callable

import uvicorn

from flaxformer_lite.serving import engine as engine_lib
from flaxformer_lite.serving.service import Limits, Translator
from flaxformer_lite.translate import line_io


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the SIGTERM or SIGINT it drained on is not raised again
    once it stopped (uvicorn re-raises it, so the process would die of the signal instead of
    exiting 0 after answering every request)."""

    @contextlib.contextmanager
    def capture_signals(self):
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclasses.dataclass(frozen=True)
class Options:
    """The flag values of serve.py (see its flag help for each)."""

    workdir: str
    step: str | int | None = None
    average: int = 1
    host: str = "127.0.0.1"
    port: int = 8080
    slots: int = 16
    beam_size: int = 4
    default_beam_size: int = 4
    max_len: int | None = None
    steps_per_sync: int = 4
    max_queue: int = 512
    max_lines: int = 256
    timeout: float = 60.0
    batching: str = "continuous"
    warm_up: bool = True

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check(o: Options, run_config) -> None:
    """Refuses settings and workdirs the server cannot serve, in one line each."""
    if run_config.nat is not None or run_config.copy is not None:
        kind = "non-autoregressive" if run_config.nat is not None else "copy-head"
        raise line_io.InputError(
            f"{o.workdir} holds a {kind} model; serve.py serves autoregressive models with a "
            "plain softmax output (decode.py decodes this one)"
        )
    if run_config.model.input_features:
        raise line_io.InputError(f"{o.workdir} reads speech features; serve.py serves text")
    if o.batching not in ("continuous", "static"):
        raise line_io.InputError(f"--batching must be continuous or static, got {o.batching!r}")
    if not 1 <= o.default_beam_size <= o.beam_size:
        raise line_io.InputError("need 1 <= --default_beam_size <= --beam_size")
    if o.max_len is not None and o.max_len < 2:
        raise line_io.InputError(f"need --max_len >= 2, got {o.max_len}")
    positions = run_config.model
    if positions.positions == "learned" and (o.max_len or 0) > positions.max_len:
        raise line_io.InputError(f"--max_len exceeds the model's {positions.max_len} positions")


def build(o: Options) -> Translator:
    """The workdir's model behind a started engine (compiled when `o.warm_up`)."""
    from flaxformer_lite.models import from_config
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import runner

    run_config, vocab = runner.open_workdir(o.workdir, o.step)
    check(o, run_config)
    params, _ = restore.restore_params(o.workdir, o.step, average=o.average, log=log)
    model = from_config.build_model(run_config)
    engine = engine_lib.Engine(
        model.module,
        engine_lib.params_on_device(params),
        slots=o.slots,
        beam_size=o.beam_size,
        source_len=run_config.data.max_source_len,
        max_len=o.max_len or run_config.data.max_target_len,
        steps_per_sync=o.steps_per_sync,
        max_queue=o.max_queue,
        continuous=o.batching == "continuous",
    )
    if o.warm_up:
        log(f"compiled the engine's programs in {engine_lib.warm_up(engine):.1f} s")
    limits = Limits(max_lines=o.max_lines, default_beam_size=o.default_beam_size, timeout=o.timeout)
    return Translator(engine.start(), vocab, run_config, limits, model=model, params=params)


def run(o: Options, on_ready: Callable[[], object] = lambda: None) -> None:
    """Serves until SIGINT/SIGTERM; requests in flight are answered before it returns."""
    from flaxformer_lite.serving.app import make_app

    translator = build(o)
    on_ready()
    config = uvicorn.Config(
        make_app(translator),
        host=o.host,
        port=o.port,
        log_level="warning",
        timeout_graceful_shutdown=o.timeout + 5,
    )
    log(
        f"serving {o.workdir} on http://{o.host}:{o.port} ({o.batching} batching, "
        f"{o.slots} slots per pool, beams <= {o.beam_size})"
    )
    DrainingServer(config).run()
    log("drained and stopped")
