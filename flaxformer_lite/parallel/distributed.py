"""Multi-host start-up: joining a job's processes and ordering work between them.

Several processes (hosts) form one job after `initialize_distributed`; the
device mesh (`partitioning.make_mesh`) then spans every process's devices.
`process_0_first` runs a step on process 0 before the others, so that they
read what it wrote.

When a process dies, JAX's coordination service (run by process 0) ends the
job instead of leaving the others blocked in their next collective. With a
dead process k > 0, the service declares it dead once `heartbeat_timeout_s`
has passed since its last heartbeat, and every other process aborts (SIGABRT:
status 134 in a shell) with, on stderr:

  E... coordination_service.cc:...] ... UNAVAILABLE: The following tasks are
  unhealthy (stopped sending heartbeats):
  k
  F... client.h:80] Terminating process because the JAX distributed service
  detected fatal errors. This most likely indicates that another task died;
  see the other task logs for more details. ...

then a C++ stack trace and (train.py: absl turns on faulthandler) "Fatal
Python error: Aborted" with every Python thread's stack. A dead process 0
takes the service with it: the others abort at once with the same F line and
"Failed to send RPC to coordination service. Either the leader task was
preempted/died/restarted unexpectedly ...". Restarting every process with the
same arguments resumes from the last complete checkpoint.

The message is the runtime's: JAX 0.10 has no hook to replace it.
`jax.distributed.initialize` passes no `missed_heartbeat_callback` to the
runtime client, and a client given a Python one aborts with std::bad_cast
when it calls it. A process that hangs while alive keeps sending heartbeats
(a runtime thread sends them), so this does not end a job stuck on such a
peer; `training.watchdog` does.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from flaxformer_lite.config import ConfigError

# Environment variables read when the arguments of `initialize_distributed` are
# None. JAX 0.10 itself reads only the first; the other two are this library's.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedError(RuntimeError):
    """The processes of a multi-host job could not be set up; the message says why."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} must be an integer") from None


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"coordinator address {address!r} must be host:port, e.g. 10.0.0.1:1234 (the "
            "address of process 0 and a free port on it)"
        )
    return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, timeout_s: float, who: str) -> None:
    """Polls until the coordinator's port accepts TCP connections.

    JAX aborts the whole process (no Python exception) when it cannot reach the
    coordinator, so the common failures are caught here first, with a message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, port)
        except socket.gaierror as e:
            raise DistributedError(f"{who}: cannot resolve coordinator host {host!r}: {e}") from e
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"{who}: the coordinator {host}:{port} did not answer within {timeout_s:.0f} s "
                    f"({e}); start process 0 with the same --coordinator_address, and check that "
                    "this host can reach that address and port"
                ) from e
            time.sleep(0.5)


def _check_port_free(port: int, who: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator will
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(
                f"{who}: cannot listen on port {port} for the coordinator ({e}); pick a free "
                "port in --coordinator_address"
            ) from e


def _set_local_device_count(local_device_count: int | None) -> None:
    """CPU only: makes this process simulate `local_device_count` devices (None: leave as is)."""
    if local_device_count is None:
        return
    if local_device_count < 1:
        raise ConfigError(f"local_device_count must be >= 1, got {local_device_count}")
    try:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    except RuntimeError as e:  # devices already created
        raise DistributedError(f"local_device_count: {e}") from e


def _resolve_job(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> tuple[str, int, int] | None:
    """(address, count, index) from the arguments or the environment; None for one process.

    Raises ConfigError when they are incomplete or inconsistent.
    """
    address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    count = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    index = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if count in (None, 1) and index in (None, 0):
        return None  # one process: nothing to coordinate (a coordinator address alone is ignored)
    if address is None or count is None or index is None:
        raise ConfigError(
            "a multi-process job needs --coordinator_address, --num_processes and --process_id "
            f"(or ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}); got "
            f"{address!r}, {count!r}, {index!r}"
        )
    if count < 1 or not 0 <= index < count:
        raise ConfigError(
            f"process_id must be in [0, num_processes), got process_id={index}, "
            f"num_processes={count}"
        )
    _split_address(address)  # validated before anything else happens
    return address, count, index


def _use_gloo_on_cpu() -> None:
    """CPU processes exchange gradients through gloo (TCP); accelerators use their own
    interconnect and ignore this. An explicit user choice such as "mpi" is kept."""
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _precheck_coordinator(address: str, index: int, timeout_s: float, who: str) -> None:
    """Process 0: its port is free; the others: process 0 answers (JAX would abort instead)."""
    host, port = _split_address(address)
    if index == 0:
        _check_port_free(port, who)
    else:
        _wait_for_coordinator(host, port, timeout_s, who)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    initialization_timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
    shutdown_timeout_s: int = 300,
) -> None:
    """Joins this process to a multi-process job; call it before anything touches devices.

    A no-op beyond `local_device_count` for a single process (no arguments and
    none of the environment variables above). Otherwise every process runs the
    same program with the same `coordinator_address` (host:port of process 0)
    and `num_processes`, and its own `process_id` in [0, num_processes).

    Args:
      coordinator_address, num_processes, process_id: None: read from
        $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID.
      local_device_count: CPU only: how many devices this process simulates
        (as XLA_FLAGS=--xla_force_host_platform_device_count); accelerators
        always use all their local devices.
      initialization_timeout_s: how long processes wait for each other at start.
      heartbeat_timeout_s: a process silent this long (seconds, >= 1) is
        declared dead, and the runtime then aborts all the others instead of
        letting them hang in the next collective (see the module docstring
        for what they print). JAX's default is 100.
      shutdown_timeout_s: how long an exiting process waits for the others.
    Raises:
      ConfigError: inconsistent arguments.
      DistributedError: JAX's devices were already in use, the coordinator's
        port is taken, or (process > 0) the coordinator cannot be reached.
        Process 0 waiting for peers that never come is aborted by JAX after
        `initialization_timeout_s` (DEADLINE_EXCEEDED on stderr).
    """
    if heartbeat_timeout_s < 1:
        raise ConfigError(f"heartbeat_timeout_s must be >= 1 second, got {heartbeat_timeout_s}")
    _set_local_device_count(local_device_count)
    job = _resolve_job(coordinator_address, num_processes, process_id)
    if job is None or jax.distributed.is_initialized():
        return
    address, count, index = job
    _use_gloo_on_cpu()
    who = f"process {index} of {count}"
    _precheck_coordinator(address, index, initialization_timeout_s, who)
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=index,
            initialization_timeout=initialization_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            shutdown_timeout_seconds=shutdown_timeout_s,
        )
    except RuntimeError as e:  # devices already created; failures to connect abort instead
        raise DistributedError(f"{who}: {e}") from e


T = TypeVar("T")


def _all_ok(ok: bool) -> np.ndarray:
    """bool[P]: every process's `ok` (a collective: all processes must call it)."""
    return multihost_utils.process_allgather(np.int32(ok)).reshape(-1).astype(bool)


def process_0_first(fn: Callable[[], T], what: str) -> T:
    """Runs `fn` on process 0, then on the others: process 0 writes, they read what it wrote.

    With one process this is `fn()`. If `fn` fails anywhere, every process
    raises (the failing ones their own error), so that none is left waiting in
    a collective for a peer that has gone.
    """
    if jax.process_count() == 1:
        return fn()
    result, failure = None, None

    def attempt():
        nonlocal result, failure
        try:
            result = fn()
        except Exception as e:  # re-raised below, once every process knows
            failure = e

    for turn in ("first", "then"):
        if (jax.process_index() == 0) == (turn == "first"):
            attempt()
        ok = _all_ok(failure is None)
        if failure is not None:
            raise failure
        if not ok.all():
            failed = ", ".join(str(i) for i in np.flatnonzero(~ok))
            raise DistributedError(f"process(es) {failed} failed while {what}; their logs say why")
    return result
