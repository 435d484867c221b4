"""The hang watchdog: limits from the median of recent durations, one report, a real exit.

The in-process tests drive the watchdog's clock by hand (its thread polls every
few milliseconds), so that their numbers are exact; one subprocess test lets a
real sleep hang and checks the exit status and the stacks.
"""

import re
import subprocess
import sys
import threading
import time
import types

import pytest
from conftest import ROOT

from flaxformer_lite.training import watchdog as watchdog_lib
from flaxformer_lite.training.watchdog import EXIT_HANG, Watchdog


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(watchdog_lib, "time", types.SimpleNamespace(monotonic=clock))
    return clock


def run(watchdog: Watchdog, clock: Clock, kind: str, seconds: float, what: str = "") -> None:
    with watchdog.watch(kind, what or kind):
        clock.now += seconds


def settle(watchdog: Watchdog) -> None:
    """Waits several polls of the watchdog's thread."""
    time.sleep(10 * watchdog.poll_seconds)


def watchdog_threads() -> list[threading.Thread]:
    """The live threads a Watchdog started (it names them "watchdog")."""
    return [t for t in threading.enumerate() if t.name == "watchdog"]


def wait_for(reports: list, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not reports and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_step_past_factor_times_the_median_is_reported_once(clock):
    reports = []
    with Watchdog(
        factor=3, min_seconds=1, window=3, on_hang=reports.append, poll_seconds=0.002
    ) as watchdog:
        for seconds in (2, 4, 10, 6):
            run(watchdog, clock, "step", seconds)
        assert watchdog.limit("step") == 18  # 3 x median(4, 10, 6): the last `window` steps
        watchdog.start("step", "step 5")
        clock.now += 17.9
        settle(watchdog)
        assert reports == []
        clock.now += 0.6
        wait_for(reports)
        settle(watchdog)
        watchdog.done()
    assert reports == [
        "error: step 5 has run for 18.5 s, more than 3x the median step time of 6 s "
        "(limit 18 s); thread stacks follow"
    ]


def test_the_limit_is_never_below_min_seconds(clock):
    reports = []
    with Watchdog(factor=3, min_seconds=5, on_hang=reports.append, poll_seconds=0.002) as wd:
        run(wd, clock, "save", 0.5)
        assert wd.limit("save") == 5
        wd.start("save", "checkpoint 20")
        clock.now += 4.9
        settle(wd)
        assert reports == []
        clock.now += 0.2
        wait_for(reports)
    assert reports == [
        "error: checkpoint 20 has run for 5.1 s, more than 3x the median save time of 0.5 s "
        "(limit 5 s); thread stacks follow"
    ]


def test_no_history_of_the_kind_means_no_limit(clock):
    reports = []
    with Watchdog(factor=2, min_seconds=1, on_hang=reports.append, poll_seconds=0.002) as wd:
        with wd.watch("step", "step 0"):  # the first step compiles: no limit
            clock.now += 1e6
            settle(wd)
        for _ in range(2):
            run(wd, clock, "step", 1)
        assert wd.limit("step") == 2 and wd.limit("eval") is None  # median(1e6, 1, 1) = 1
        with wd.watch("eval", "validation at step 500"):  # steps say nothing about evaluations
            clock.now += 1e6
            settle(wd)
    assert reports == []


def test_an_activity_done_in_time_is_not_reported(clock):
    reports = []
    with Watchdog(factor=2, min_seconds=1, on_hang=reports.append, poll_seconds=0.002) as wd:
        run(wd, clock, "step", 3)
        with wd.watch("step", "step 1"):
            clock.now += 5.9  # limit 6
            settle(wd)
        clock.now += 100  # between activities nothing is timed
        settle(wd)
    assert reports == []


def test_a_failed_activity_adds_no_duration(clock):
    with Watchdog(factor=2, min_seconds=1, on_hang=lambda m: None) as wd:
        run(wd, clock, "step", 3)
        with pytest.raises(ValueError), wd.watch("step", "step 1"):
            clock.now += 50
            raise ValueError("boom")
        assert wd.limit("step") == 6
        wd.start("step", "step 2")
        with pytest.raises(RuntimeError, match="'step 3' started while 'step 2'"):
            wd.start("step", "step 3")
        wd.done()


def test_factor_zero_starts_no_thread(clock):
    before, watchdogs = threading.active_count(), watchdog_threads()
    wd = Watchdog(factor=0, min_seconds=1, on_hang=lambda m: pytest.fail(m))
    assert not wd.enabled and watchdog_threads() == watchdogs
    assert threading.active_count() == before
    run(wd, clock, "step", 1)
    with wd.watch("step", "step 1"):
        clock.now += 1e6
    assert wd.limit("step") is None
    wd.close()


def test_close_stops_the_daemon_thread():
    others = watchdog_threads()
    wd = Watchdog(factor=2, min_seconds=1, on_hang=lambda m: None)
    (thread,) = [t for t in watchdog_threads() if t not in others]
    assert thread.daemon and thread.is_alive()
    wd.close()
    assert not thread.is_alive() and watchdog_threads() == others


# A training loop whose sixth step hangs in a function with a name to look for.
HANGING_LOOP = """
import sys, time
sys.path.insert(0, {root!r})
from flaxformer_lite.training.watchdog import Watchdog

def wait_for_the_lost_peer():
    time.sleep(60)

watchdog = Watchdog(factor=5, min_seconds=0.5, poll_seconds=0.05)
for step in range(5):
    with watchdog.watch("step", f"step {{step}}"):
        time.sleep(0.01)
with watchdog.watch("step", "step 5"):
    wait_for_the_lost_peer()
print("not reached")
"""


def test_a_hang_ends_the_process_with_the_stacks():
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", HANGING_LOOP.format(root=ROOT)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    took = time.monotonic() - started
    assert result.returncode == EXIT_HANG, result.stderr[-3000:]
    assert took < 20, took
    assert "not reached" not in result.stdout
    first = result.stderr.splitlines()[0]
    assert re.fullmatch(
        r"error: step 5 has run for [\d.]+ s, more than 5x the median step time of "
        r"[\d.]+ s \(limit 0\.5 s\); thread stacks follow",
        first,
    ), first
    stacks = result.stderr.split("\n", 1)[1]
    assert "Thread MainThread" in stacks and "Thread watchdog" not in stacks
    assert "in wait_for_the_lost_peer" in stacks, stacks
