"""The server under load against `decode.py` on the same file: sentences/s and latency.

`bench.py --mode serve --serve_workdir W --serve_input F` runs, for greedy and beam search:

  (c) `decode.py`'s library on the whole file (warm: the second of two passes);
  (a) `serve.py` with continuous batching, (b) the same server batching whole batches
      (`--batching static`): closed loop, `clients` clients each sending one line per
      request until every line is answered (throughput, p50/p99 latency); then open loop
      at half the measured throughput (Poisson arrivals: p50/p99 at half load) and at
      twice it against a short queue (503s counted, every accepted request answered, the
      server's resident memory before and after).

Every answer is checked against (c): greedy texts equal, beam texts equal; a request lost,
duplicated or different is counted, and reported.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from flaxformer_lite.serving.client import Client, ServerError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reference(workdir: str, lines: list[str], beam_size: int, batch_size: int = 32) -> dict:
    """decode.py's texts of `lines` and the seconds of a warm pass over them."""
    from flaxformer_lite.models import from_config
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import runner

    run_config, vocab = runner.open_workdir(workdir)
    params, _ = restore.restore_params(workdir, None)
    model = from_config.build_model(run_config)
    search = runner.make_search(run_config, beam_size=beam_size)
    decode = lambda: runner.decode_lines(
        model, params, vocab, run_config, lines, search=search, batch_size=batch_size
    )
    decode()  # compiles
    start = time.perf_counter()
    result = decode()
    return {"texts": result.texts, "seconds": time.perf_counter() - start}


class Server:
    """serve.py in a subprocess on a free port (warmed up before it listens)."""

    def __init__(self, workdir: str, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "serve.py", "--workdir", workdir, "--port", str(port), *args]
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.client = Client(f"http://127.0.0.1:{port}", timeout=300)
        deadline = time.monotonic() + 600
        while True:
            try:
                self.client.health()
                return
            except (OSError, ServerError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"serve.py did not start: {self.process.stderr.read()}"
                    ) from None
                time.sleep(0.25)

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        return kb / 1024

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(timeout=300)


def closed_loop(client: Client, lines: list[str], clients: int, **fields) -> dict:
    """Each client sends the next unsent line until none is left; one line per request."""
    answers: dict[int, str] = {}
    latencies: list[float] = []
    todo = iter(range(len(lines)))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            start = time.perf_counter()
            text = client.translate([lines[i]], **fields)[0]["hypotheses"][0]["text"]
            with lock:
                latencies.append(time.perf_counter() - start)
                answers[i] = text

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(work) for _ in range(clients)]:
            f.result()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "answers": answers, **_percentiles(latencies)}


def open_loop(client: Client, lines: list[str], rate: float, duration: float, **fields) -> dict:
    """Requests of one line each at Poisson arrivals of `rate`/s for `duration` s."""
    rng = random.Random(0)
    results: list[tuple[int, str | ServerError, float]] = []
    lock = threading.Lock()

    def send(i: int):
        start = time.perf_counter()
        try:
            out = client.translate([lines[i % len(lines)]], **fields)[0]["hypotheses"][0]["text"]
        except ServerError as e:
            out = e
        with lock:
            results.append((i, out, time.perf_counter() - start))

    with concurrent.futures.ThreadPoolExecutor(256) as pool:
        begin, at, i, futures = time.perf_counter(), 0.0, 0, []
        while at < duration:
            time.sleep(max(0.0, begin + at - time.perf_counter()))
            futures.append(pool.submit(send, i))
            at, i = at + rng.expovariate(rate), i + 1
        for f in futures:
            f.result()
    ok = [r for r in results if not isinstance(r[1], ServerError)]
    refused = [r for r in results if isinstance(r[1], ServerError) and r[1].status == 503]
    return {
        "sent": len(results),
        "answered": len(ok),
        "refused_503": len(refused),
        "other_errors": len(results) - len(ok) - len(refused),
        "results": results,
        **_percentiles([r[2] for r in ok]),
    }


def _percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"p50_s": None, "p99_s": None}
    return {
        "p50_s": float(np.percentile(latencies, 50)),
        "p99_s": float(np.percentile(latencies, 99)),
    }


def mismatches(answers: dict[int, str], want: list[str]) -> int:
    """Lines lost or answered differently from `want` (index i of line i)."""
    return sum(answers.get(i) != text for i, text in enumerate(want))


def run(
    workdir: str,
    lines: list[str],
    *,
    clients: int = 32,
    slots: int = 32,
    duration: float = 20.0,
    log: Callable[[str], None] = print,
) -> dict:
    """Every measurement of the module docstring, for greedy and beam 4."""
    out = {}
    for name, beam in (("greedy", 1), ("beam4", 4)):
        ref = reference(workdir, lines, beam)
        row = {"decode_py_s": ref["seconds"], "decode_py_sent_per_s": len(lines) / ref["seconds"]}
        log(f"{name}: decode.py {row['decode_py_sent_per_s']:.1f} sentences/s")
        for batching in ("continuous", "static"):
            server = Server(
                workdir,
                "--slots",
                str(slots),
                "--beam_size",
                "4",
                "--batching",
                batching,
                "--max_queue",
                "4096",
            )
            loaded = closed_loop(server.client, lines, clients, beam_size=beam)
            row[batching] = {
                "sent_per_s": len(lines) / loaded["seconds"],
                "p50_s": loaded["p50_s"],
                "p99_s": loaded["p99_s"],
                "mismatched_or_lost": mismatches(loaded["answers"], ref["texts"]),
            }
            log(f"{name}: {batching} server {row[batching]}")
            if batching == "continuous":
                half = open_loop(
                    server.client, lines, row[batching]["sent_per_s"] / 2, duration, beam_size=beam
                )
                row["half_load"] = {k: v for k, v in half.items() if k != "results"}
                log(f"{name}: half load {row['half_load']}")
            server.stop()
        row["overload"] = _overload(workdir, lines, row, slots, duration, beam, ref["texts"])
        log(f"{name}: 2x overload {row['overload']}")
        out[name] = row
    return out


def run_file(workdir: str | None, input_path: str | None, **kwargs) -> dict:
    """`run` on the non-blank lines of a file (`bench.py --mode serve`)."""
    from flaxformer_lite.translate import line_io

    if not workdir or not input_path:
        raise line_io.InputError("--mode serve needs --serve_workdir and --serve_input")
    lines, _ = line_io.read_lines(input_path)
    return run(workdir, [line for line in lines if line.strip()], **kwargs)


def _overload(workdir, lines, row, slots, duration, beam, want) -> dict:
    """Twice the measured throughput against a queue of two batches: refused with 503,
    every accepted request answered right, memory before and after."""
    server = Server(
        workdir, "--slots", str(slots), "--beam_size", "4", "--max_queue", str(2 * slots)
    )
    before = server.rss_mib()
    load = open_loop(
        server.client, lines, 2 * row["continuous"]["sent_per_s"], duration, beam_size=beam
    )
    after = server.rss_mib()
    wrong = sum(
        out != want[i % len(want)]
        for i, out, _ in load["results"]
        if not isinstance(out, ServerError)
    )
    code = server.stop()
    return {
        **{k: v for k, v in load.items() if k != "results"},
        "wrong_answers": wrong,
        "rss_mib_before": before,
        "rss_mib_after": after,
        "exit_code": code,
    }
