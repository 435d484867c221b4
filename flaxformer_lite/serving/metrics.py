"""The server's counters and latency histogram, written in the Prometheus text format.

Plain Python (the figures are few and the format is simple): counters only go up, so a
scraper's rate() gives requests/s and tokens/s; gauges are read from the engine when
scraped.
"""

from __future__ import annotations

import bisect
import collections
import threading

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "flaxformer_lite"


class Metrics:
    """Request counts by status, sentences, and a histogram of request latency (seconds)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()  # by HTTP status
        self.sentences = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: +Inf
        self.latency_sum = 0.0

    def observe(self, status: int, seconds: float, sentences: int = 0) -> None:
        with self._lock:
            self.requests[status] += 1
            self.sentences += sentences
            if status == 200:
                self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
                self.latency_sum += seconds

    def render(self, gauges: dict[str, float], stats: dict[str, float]) -> str:
        """The exposition text: these counters, the engine's `stats` and its `gauges`."""
        p = PREFIX
        out = [
            f"# HELP {p}_requests_total Requests answered, by HTTP status.",
            f"# TYPE {p}_requests_total counter",
        ]
        with self._lock:
            out += [
                f'{p}_requests_total{{code="{c}"}} {n}' for c, n in sorted(self.requests.items())
            ]
            out += _counter(f"{p}_sentences_total", "Lines translated.", self.sentences)
            out += [
                f"# HELP {p}_request_latency_seconds Time from request to answer (status 200).",
                f"# TYPE {p}_request_latency_seconds histogram",
            ]
            running = 0
            for bound, count in zip((*LATENCY_BUCKETS, "+Inf"), self.buckets, strict=True):
                running += count
                out.append(f'{p}_request_latency_seconds_bucket{{le="{bound}"}} {running}')
            out.append(f"{p}_request_latency_seconds_sum {self.latency_sum:.6f}")
            out.append(f"{p}_request_latency_seconds_count {running}")
        out += _counter(
            f"{p}_generated_tokens_total", "Tokens decoded (EOS included).", stats.get("tokens", 0)
        )
        out += _counter(
            f"{p}_slot_steps_total", "Slots stepped (busy or not).", stats.get("slot_steps", 0)
        )
        out += _counter(
            f"{p}_busy_slot_steps_total",
            "Slots stepped holding a sentence; over slot_steps_total: the batch occupancy.",
            stats.get("busy_slot_steps", 0),
        )
        out += _gauge(f"{p}_queue_depth", "Sentences waiting for a slot.", gauges["queue"])
        out += [
            f"# HELP {p}_slots_busy Slots holding a sentence, by pool.",
            f"# TYPE {p}_slots_busy gauge",
        ]
        pools = sorted(k[5:] for k in gauges if k.startswith("busy_"))
        out += [f'{p}_slots_busy{{pool="{name}"}} {gauges["busy_" + name]}' for name in pools]
        out += [f"# HELP {p}_slots Slots per pool.", f"# TYPE {p}_slots gauge"]
        out += [f'{p}_slots{{pool="{name}"}} {gauges["slots_" + name]}' for name in pools]
        return "\n".join(out) + "\n"


def _counter(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
