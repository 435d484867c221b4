"""Multi-process data parallelism: two processes train like one, a dead peer ends the job
within the heartbeat timeout, and the restarted job resumes from its last checkpoint.

Also: each process reads its own rows of every batch, and bad setups fail with one line.
The job tests start real JAX processes on 127.0.0.1 (gloo collectives, 2 simulated
CPU devices each) in subprocesses with timeouts, since a process whose peer
dies is terminated by the JAX runtime. The peers are killed with SIGKILL: a
process that is told to stop may save a checkpoint first, a killed one cannot.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import pytest
from conftest import ROOT, assert_params_close, tiny_config, without_compilation_cache

from flaxformer_lite import datasets
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config import run as run_config
from flaxformer_lite.data import numbers, pipeline
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.parallel import distributed
from flaxformer_lite.training import checkpoint_format, load_state, loop

PROCESSES, LOCAL_DEVICES = 2, 2

# One process of a job: joins it, trains, and (all processes together) restores the result.
SCRIPT = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {root!r} + "/tests")
from flaxformer_lite.parallel import distributed, partitioning
distributed.initialize_distributed(
    {address!r}, {processes}, {index}, local_device_count={local},
    initialization_timeout_s=60, shutdown_timeout_s=30,
)
import jax
import numpy as np
from conftest import tiny_config
from flaxformer_lite.config.run import parse
from flaxformer_lite.training import load_state, loop
assert jax.device_count() == {processes} * {local}, jax.devices()
{body}
"""

# Trains; all processes restore the checkpoint together; process 0 saves the parameters.
TRAIN = """
import json
config = tiny_config({tfds!r}, num_steps=8, checkpoint_every=8, exposure_report=True)
results = loop.train_and_evaluate(parse(config), {workdir!r}, log=print)
with open(f"{out}.{{jax.process_index()}}.json", "w") as f:
    json.dump(results, f)
_, state, _, _ = load_state.restore_trained({workdir!r})
if jax.process_index() == 0:
    leaves = {{jax.tree_util.keystr(p): np.asarray(x) for p, x in
              jax.tree_util.tree_flatten_with_path(state.params)[0]}}
    np.savez({out!r}, **leaves)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(body: str, tmp_path, **fields) -> list[subprocess.Popen]:
    """Starts the processes of one job; their output goes to tmp_path/process_<i>.log."""
    # local_device_count sets the device count; the suite's other XLA flags are kept.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = without_compilation_cache(
        dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    )
    address = f"127.0.0.1:{_free_port()}"
    procs = []
    for index in range(PROCESSES):
        code = SCRIPT.format(
            root=ROOT,
            address=address,
            processes=PROCESSES,
            index=index,
            local=LOCAL_DEVICES,
            body=body.format(**fields),
        )
        log = open(tmp_path / f"process_{index}.log", "w")  # noqa: SIM115 (closed by the child)
        procs.append(
            subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log)
        )
        log.close()
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("repeat", [True, False])
def test_each_process_reads_its_rows_of_every_global_batch(repeat):
    split = numbers.generate_pairs(["de"], 99, seed=1, valid_fraction=0.0, test_fraction=0.0)
    source = [{"source": s, "target": t} for s, t in split["train"]]  # 100 examples
    tok = Tokenizer.train([e["source"] for e in source] + [e["target"] for e in source], 200)
    common = dict(max_source_len=8, max_target_len=24, seed=0, shuffle=True, repeat=repeat)
    whole = pipeline.make_dataset(source, tok, batch_size=16, drop_remainder=True, **common)
    parts = [
        pipeline.make_dataset(
            source,
            tok,
            batch_size=16,
            drop_remainder=True,
            process_index=p,
            process_count=4,
            **common,
        )
        for p in range(4)
    ]
    if not repeat:
        assert len(whole) == 6 and all(len(part) == 6 for part in parts)
    for step in (0, 5) + ((6, 13) if repeat else ()):  # both epochs when repeating
        for key, rows in whole[step].items():
            np.testing.assert_array_equal(np.concatenate([p[step][key] for p in parts]), rows)
    if not repeat:
        with pytest.raises(ValueError, match="partial batch"):
            pipeline.make_dataset(
                source, tok, batch_size=16, drop_remainder=False, process_count=4, **common
            )


def _params(workdir: str) -> dict:
    """The trained parameters restored from a workdir, by their key paths."""
    _, state, _, _ = load_state.restore_trained(workdir)
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
    }


def _train_one_device(tfds_dir: str, workdir: str) -> dict:
    """TRAIN's run in this test process, on its one device: the same config, data and
    `train_and_evaluate`."""
    assert jax.device_count() == 1, jax.devices()
    config = run_config.parse(tiny_config(tfds_dir, num_steps=8, checkpoint_every=8))
    loop.train_and_evaluate(config, workdir, log=lambda s: None)
    return _params(workdir)


@pytest.fixture(scope="module")
def prepared_tfds(tfds_dir):
    """The tiny task prepared once here, so that the processes only read it."""
    datasets.load_splits(run_config.parse(tiny_config(tfds_dir)).data)
    return tfds_dir


def test_two_processes_train_like_one(prepared_tfds, tmp_path):
    out = str(tmp_path / "params_2x2.npz")
    workdir = str(tmp_path / "run_2x2")
    procs = _launch(TRAIN, tmp_path, tfds=prepared_tfds, workdir=workdir, out=out)
    try:
        # The 1-device reference shares the CPU with the job meanwhile; the 4-device
        # single-process steps are compared with 1 device in test_sharding.py.
        one = _train_one_device(prepared_tfds, str(tmp_path / "run_1"))
        for index, p in enumerate(procs):
            code = p.wait(timeout=240)
            log = (tmp_path / f"process_{index}.log").read_text()
            assert code == 0, f"process {index} exited with {code}:\n{log[-3000:]}"
    finally:
        _stop(procs)
    logs = [(tmp_path / f"process_{i}.log").read_text() for i in range(PROCESSES)]
    assert "step 8 test:" in logs[0]
    assert "step 8 test:" not in logs[1]  # only process 0 logs
    # Evaluation gathered every hypothesis onto both processes: the same metrics.
    metrics = [json.loads((tmp_path / f"params_2x2.npz.{i}.json").read_text()) for i in range(2)]
    assert metrics[0] == metrics[1] and metrics[0]["step"] == 8
    # The exposure report gathered its per-example arrays too: every row counted once.
    assert metrics[0]["test_eb_tf_token_accuracy"] == pytest.approx(
        metrics[0]["test_token_accuracy"]
    )
    two = dict(np.load(out))
    assert_params_close(two, one)


HEARTBEAT_S = 5  # short, so that a dead peer is declared dead soon
# From the last heartbeat the service saw to the survivor's exit: the service checks its
# deadlines every second or so, and two loaded cores may delay any process by seconds.
EXIT_MARGIN_S = 15


def _launch_train_py(tmp_path, tfds_dir: str, workdir: str, num_steps: int):
    """Starts train.py as each process of a job; the output goes to tmp_path/process_<i>.log.

    The tiny config with a checkpoint every 2 steps; every process gets the same
    arguments but its --process_id, as on a cluster.
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = without_compilation_cache(
        dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"]),
        )
    )
    args = [
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.data.tfds_dir={tfds_dir}",
        "--config.train.tensorboard=False",
        "--config.train.num_examples_to_print=0",
        "--config.train.checkpoint_every=2",
        f"--config.train.num_steps={num_steps}",
        f"--coordinator_address=127.0.0.1:{_free_port()}",
        f"--num_processes={PROCESSES}",
        f"--heartbeat_timeout_s={HEARTBEAT_S}",
    ]
    procs = []
    for index in range(PROCESSES):
        log = open(tmp_path / f"process_{index}.log", "w")  # noqa: SIM115 (closed by the child)
        command = [sys.executable, "train.py", *args, f"--process_id={index}"]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log))
        log.close()
    return procs


def _wait_for(done: Callable[[], bool], procs, tmp_path, what: str, timeout: float = 120) -> None:
    """Polls `done` while every process of the job still runs."""
    deadline = time.monotonic() + timeout
    while not done():
        for index, p in enumerate(procs):
            log = (tmp_path / f"process_{index}.log").read_text()
            assert p.poll() is None, f"process {index} exited with {p.returncode}:\n{log[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def _kill_and_wait(procs, victim: int) -> tuple[int, float]:
    """SIGKILLs process `victim`; (exit status of the other, seconds it took to exit)."""
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = procs[1 - victim].wait(timeout=HEARTBEAT_S + 90)
    return code, time.monotonic() - killed


@pytest.mark.parametrize(
    "victim", [1, pytest.param(0, marks=pytest.mark.slow)], ids=["worker", "coordinator"]
)
def test_dead_peer_ends_the_job(prepared_tfds, tmp_path, victim):
    """The survivor exits non-zero within the heartbeat timeout, with JAX's reason, and
    the last complete checkpoint restores (the restarted job is the slow test below).

    A dead worker: the coordination service (in process 0) misses its heartbeats
    for --heartbeat_timeout_s and tells process 0, whose client aborts. A dead
    process 0: the others lose the service's connection and abort at once.
    """
    workdir = str(tmp_path / "run")
    procs = _launch_train_py(tmp_path, prepared_tfds, workdir, num_steps=100_000)
    try:
        _wait_for(lambda: checkpoint_format.list_steps(workdir), procs, tmp_path, "a checkpoint")
        code, waited = _kill_and_wait(procs, victim)
    finally:
        _stop(procs)
    print(f"survivor exited {waited:.1f} s after the kill")
    log = (tmp_path / f"process_{1 - victim}.log").read_text()
    assert code == -signal.SIGABRT, log[-3000:]  # LOG(FATAL) in JAX's client
    assert waited < HEARTBEAT_S + EXIT_MARGIN_S, waited
    assert "another task died" in log, log[-3000:]
    if victim == 1:
        assert "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in log
    else:
        assert "Either the leader task was preempted/died/restarted unexpectedly" in log
    _, state, _, _ = load_state.restore_trained(workdir)
    assert int(state.step) == checkpoint_format.list_steps(workdir)[-1]


@pytest.mark.slow
def test_a_killed_job_restarted_resumes_from_its_last_checkpoint(prepared_tfds, tmp_path):
    """One process SIGKILLed after a few checkpoints; both restarted with the same arguments."""
    workdir, steps = str(tmp_path / "run"), 16
    first = tmp_path / "first"
    first.mkdir()
    procs = _launch_train_py(first, prepared_tfds, workdir, steps)
    try:
        reached_4 = lambda: max(checkpoint_format.list_steps(workdir), default=0) >= 4
        _wait_for(reached_4, procs, first, "checkpoint 4")
        code, _ = _kill_and_wait(procs, victim=1)
    finally:
        _stop(procs)
    assert code != 0
    last = checkpoint_format.list_steps(workdir)[-1]  # a save cut short does not count
    assert 4 <= last < steps
    procs = _launch_train_py(tmp_path, prepared_tfds, workdir, steps)
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        _stop(procs)
    log = (tmp_path / "process_0.log").read_text()
    assert codes == [0, 0], log[-3000:]
    assert f"resumed from step {last} in " in log
    assert f"step {steps} test:" in log
    assert checkpoint_format.list_steps(workdir)[-1] == steps


@pytest.mark.slow
def test_sigterm_to_one_process_stops_the_job_at_one_step_with_a_checkpoint(
    prepared_tfds, tmp_path
):
    """A preemption notice may reach one host only: the processes agree on the step,
    save it together and all exit 0; the restarted job resumes from it."""
    workdir = str(tmp_path / "run")
    first = tmp_path / "first"
    first.mkdir()
    procs = _launch_train_py(first, prepared_tfds, workdir, num_steps=100_000)
    try:
        _wait_for(lambda: checkpoint_format.list_steps(workdir), procs, first, "a checkpoint")
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        _stop(procs)
    logs = [(first / f"process_{i}.log").read_text() for i in range(PROCESSES)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    last = logs[0].strip().splitlines()[-1]
    assert last.startswith("preempted at step ") and "checkpoint saved" in last, logs[0][-3000:]
    step = int(last.split()[3].rstrip(";"))
    assert checkpoint_format.list_steps(workdir)[-1] == step
    procs = _launch_train_py(tmp_path, prepared_tfds, workdir, step + 2)
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        _stop(procs)
    log = (tmp_path / "process_0.log").read_text()
    assert codes == [0, 0], log[-3000:]
    assert f"resumed from step {step} in " in log


def _train_cli(tmp_path, *args: str, devices: int = 1) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    return subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path)]
        + list(args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_multihost_setups_fail_with_one_line(tmp_path):
    result = _train_cli(
        tmp_path, "--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=5"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "error: process_id must be in [0, num_processes), got process_id=5, num_processes=2"
    )
    result = _train_cli(tmp_path, "--heartbeat_timeout_s=0")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "error: flag --heartbeat_timeout_s=0: 0 is not a positive integer; see --help"
    )
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must be >= 1 second, got 0"):
        distributed.initialize_distributed("127.0.0.1:1234", 2, 1, heartbeat_timeout_s=0)
    result = _train_cli(tmp_path, "--config.train.batch_size=6", devices=4)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "error: train.batch_size=6 must be divisible by the 4 batch shards of the mesh "
        "(data=4 x fsdp=1 x model=1; 1 process(es) x 4 local devices); use e.g. 8"
    )
    # No process 0 listens: a clear error after the initialization timeout, not a JAX abort.
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r})\n"
        "from flaxformer_lite.parallel import distributed\n"
        f"distributed.initialize_distributed('127.0.0.1:{_free_port()}', 2, 1, "
        "initialization_timeout_s=1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "DistributedError: process 1 of 2: the coordinator 127.0.0.1:" in result.stderr
    assert "did not answer within 1 s" in result.stderr
