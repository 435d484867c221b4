"""Checkpoints under real faults: corrupted, truncated, missing files, bad writes, a full disk.

Each test injects the fault on disk (or in the write itself) and checks that no
good checkpoint is lost: a resume falls back to the previous step, bit for bit,
and a failed save leaves the earlier steps as they were.
"""

import glob
import json
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.training import checkpoint_format, restore
from flaxformer_lite.training.checkpoint_format import (
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointWriteError,
)
from flaxformer_lite.training.checkpoints import Checkpointer
from flaxformer_lite.training.state import TrainState
from flaxformer_lite.training.workdir import (
    CHECKPOINT_DIR,
    WorkdirError,
    check_writable,
    state_nbytes,
)

# A failed orbax read or write leaves its unfinished coroutines to the garbage collector.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def make_state(seed: int, scale: float = 1.0) -> TrainState:
    """A small train state: float32, bfloat16 and int leaves, ~70 KB of incompressible floats."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "dense": {"kernel": scale * jax.random.normal(k1, (128, 64)), "bias": jnp.zeros(64)},
        "embed": jax.random.normal(k2, (32, 16)).astype(jnp.bfloat16),
    }
    opt_state = {"mu": jax.tree.map(jnp.zeros_like, params), "count": jnp.int32(seed)}
    return TrainState(jnp.int32(seed), params, opt_state, k3)


def abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def assert_bitwise_equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def step_dir(workdir, step) -> str:
    return os.path.join(workdir, CHECKPOINT_DIR, str(step))


def array_files(workdir, step) -> list[str]:
    """The OCDBT data files of a step's state item (the zstd-compressed array chunks)."""
    pattern = os.path.join(step_dir(workdir, step), "state", "ocdbt.process_*", "d", "*")
    return sorted(glob.glob(pattern))


def flip_bytes(workdir, step) -> None:
    for path in array_files(workdir, step):
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))


def truncate(workdir, step) -> None:
    for path in array_files(workdir, step):
        os.truncate(path, os.path.getsize(path) // 2)


def delete(workdir, step) -> None:
    for path in array_files(workdir, step):
        os.remove(path)


def write_garbage(path) -> None:
    with open(path, "w") as f:
        f.write("{not json")


def garbage_meta(workdir, step) -> None:
    write_garbage(os.path.join(step_dir(workdir, step), "meta", "metadata"))


def garbage_state_metadata(workdir, step) -> None:
    write_garbage(os.path.join(step_dir(workdir, step), "state", "_METADATA"))


def edit_meta(workdir, step, edit) -> None:
    path = os.path.join(step_dir(workdir, step), "meta", "metadata")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump(edit(meta), f)


STATES = {1: make_state(1), 2: make_state(2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A workdir with steps 1 and 2 of `STATES`, saved once for the module."""
    path = str(tmp_path_factory.mktemp("faults") / "run")
    ckpt = Checkpointer(path, keep=5, save_every=1)
    for step, state in STATES.items():
        assert ckpt.save(step, state, {"note": "x"}, metrics={"loss": 1.0 / step})
    ckpt.close()
    return path


@pytest.fixture
def workdir(saved, tmp_path):
    copy = str(tmp_path / "run")
    shutil.copytree(saved, copy)
    return copy


@pytest.mark.parametrize(
    "fault", [flip_bytes, truncate, delete, garbage_meta, garbage_state_metadata]
)
def test_resume_falls_back_past_a_bad_latest_step(workdir, fault):
    fault(workdir, 2)
    messages = []
    ckpt = Checkpointer(workdir, keep=5, save_every=1, log=messages.append)
    state, meta, step = ckpt.restore_latest_good(abstract(STATES[1]))
    assert step == 1 and meta["step"] == 1
    assert_bitwise_equal(state, STATES[1])
    # One line naming the bad step and where it went; the step is kept, out of orbax's sight.
    moved = os.path.join(workdir, "checkpoints-corrupt", "2")
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"checkpoint 2 in {ckpt.directory} is unusable (")
    assert f"moved it to {moved} and falling back to step 1" in messages[0]
    assert "\n" not in messages[0]
    assert os.path.isdir(moved) and os.listdir(moved)
    assert checkpoint_format.list_steps(workdir) == [1] == ckpt.all_steps()
    # The run goes on: step 2 is saved again and reads back as saved.
    assert ckpt.save(2, STATES[2], {})
    assert_bitwise_equal(ckpt.restore(abstract(STATES[2]), 2)[0], STATES[2])
    # Bad again: set aside next to the first one, which stays as it was.
    fault(workdir, 2)
    assert ckpt.restore_latest_good(abstract(STATES[1]))[2] == 1
    assert f"moved it to {moved}.1 and" in messages[1]
    assert sorted(os.listdir(ckpt.corrupt_directory)) == ["2", "2.1"]
    ckpt.close()


def test_every_step_bad_names_them_and_moves_nothing(workdir):
    truncate(workdir, 2)
    garbage_meta(workdir, 1)
    messages = []
    ckpt = Checkpointer(workdir, keep=5, save_every=1, log=messages.append)
    with pytest.raises(CheckpointIntegrityError) as e:
        ckpt.restore_latest_good(abstract(STATES[1]))
    text = str(e.value)
    assert text.startswith(f"no usable checkpoint in {ckpt.directory}: steps 2, 1 are all unusable")
    assert "2: state unreadable" in text and "1: meta unreadable" in text
    assert "delete the workdir's checkpoints to start over or pass a new --workdir" in text
    assert messages == [] and ckpt.all_steps() == [1, 2]
    assert not os.path.exists(ckpt.corrupt_directory)
    empty = Checkpointer(os.path.join(workdir, "fresh"), keep=1, save_every=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        empty.restore_latest_good(abstract(STATES[1]))
    ckpt.close()
    empty.close()


def test_another_train_state_is_refused_not_skipped(workdir):
    ckpt = Checkpointer(workdir, keep=5, save_every=1)
    other = make_state(1)  # as if another optimiser added a moment
    other = other.replace(opt_state=other.opt_state | {"nu": other.opt_state["mu"]})
    with pytest.raises(WorkdirError, match=r"another train state .* \(9 arrays there vs 12 here\)"):
        ckpt.restore_latest_good(abstract(other))
    assert ckpt.all_steps() == [1, 2]  # nothing moved
    ckpt.close()


def test_newer_format_is_refused_not_skipped(workdir):
    edit_meta(workdir, 2, lambda m: m | {"format_version": checkpoint_format.FORMAT_VERSION + 1})
    ckpt = Checkpointer(workdir, keep=5, save_every=1)
    want = "checkpoint 2 in .* has format version 2, newer than this library's \\(1\\)"
    with pytest.raises(CheckpointFormatError, match=want):
        ckpt.restore(abstract(STATES[2]))
    with pytest.raises(CheckpointFormatError, match="upgrade flaxformer_lite"):
        ckpt.restore_latest_good(abstract(STATES[2]))
    with pytest.raises(CheckpointFormatError):
        restore.resolve_step(workdir, "latest-good")
    assert ckpt.all_steps() == [1, 2]  # nothing moved
    # A checkpoint from before format versions is an old one, and restores.
    edit_meta(workdir, 2, lambda m: {k: v for k, v in m.items() if k != "format_version"})
    assert_bitwise_equal(ckpt.restore(abstract(STATES[2]))[0], STATES[2])
    ckpt.close()


def save_verified(ckpt: Checkpointer, step: int, state, meta) -> bool:
    """`ckpt.save` and, when asynchronous, its verification: either raises its failure."""
    saved = ckpt.save(step, state, meta)
    ckpt.wait()
    return saved


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_write_corrupted_before_verification_is_removed(workdir, asynchronous):
    corrupt = {3}  # steps whose bytes change between the write and the read-back

    def after_write(step):
        if step in corrupt:
            flip_bytes(workdir, step)

    ckpt = Checkpointer(
        workdir, keep=1, save_every=1, asynchronous=asynchronous, after_write=after_write
    )
    with pytest.raises(CheckpointWriteError) as e:
        save_verified(ckpt, 3, make_state(3), {})
    text = str(e.value)
    assert text.startswith(f"checkpoint 3 in {ckpt.directory} was written but ")
    assert "the previous checkpoint (step 2) is kept" in text and "\n" not in text
    # keep=1 would have deleted steps 1 and 2 after a good save: both are still there.
    assert not os.path.exists(step_dir(workdir, 3))
    assert checkpoint_format.list_steps(workdir) == [1, 2] == ckpt.all_steps()
    assert_bitwise_equal(ckpt.restore(abstract(STATES[2]), 2)[0], STATES[2])
    corrupt.clear()
    assert save_verified(ckpt, 3, make_state(3), {})
    assert ckpt.all_steps() == [3]
    ckpt.close()


def test_an_asynchronous_save_is_trusted_only_once_verified(workdir):
    """The step path returns before the save is verified; older steps stay until the new one
    is; a failure is raised by the next check, once, and the run can save again."""
    import threading

    release = threading.Event()

    def after_write(step):
        if step == 3:
            assert release.wait(60)  # written, not yet verified
        if step == 4:
            flip_bytes(workdir, step)

    ckpt = Checkpointer(workdir, keep=1, save_every=1, asynchronous=True, after_write=after_write)
    assert ckpt.save(3, make_state(3), {})  # returns while the save waits
    ckpt.check()  # in flight: neither blocks nor raises
    assert {1, 2} <= set(checkpoint_format.list_steps(workdir))  # nothing deleted yet
    release.set()
    assert ckpt.all_steps() == [3]  # waits for the verification, then retention ran
    assert ckpt.save(4, make_state(4), {})
    with pytest.raises(CheckpointWriteError, match=r"checkpoint 4 .* \(step 3\) is kept"):
        while True:
            ckpt.check()  # raises once the background save failed
    ckpt.check()  # reported once
    assert checkpoint_format.list_steps(workdir) == [3]
    assert_bitwise_equal(ckpt.restore(abstract(make_state(3)))[0], make_state(3))
    assert ckpt.save(5, make_state(5), {})
    ckpt.close()  # waits for it
    assert checkpoint_format.list_steps(workdir) == [5]


def test_a_failed_save_at_close_is_raised_or_logged(workdir):
    messages = []
    for failing in (False, True):
        ckpt = Checkpointer(workdir, keep=1, save_every=1, asynchronous=True, log=messages.append)
        bad = make_state(3)
        bad = bad.replace(params=bad.params | {"embed": bad.params["embed"].at[0, 0].set(jnp.nan)})
        assert ckpt.save(3, bad, {})
        if failing:  # the run ends on another error: the save's failure is one logged line
            ckpt.close(failing=True)
            assert messages == [
                "error: state at step 3 has non-finite values (first: .params['embed']); not "
                "saved; the previous checkpoint (step 2) is kept; lower optim.learning_rate or "
                "set optim.grad_clip_norm, and rerun to resume from it"
            ]
        else:
            with pytest.raises(CheckpointWriteError, match="non-finite"):
                ckpt.close()
    assert checkpoint_format.list_steps(workdir) == [1, 2]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_non_finite_state_is_refused(workdir, asynchronous):
    ckpt = Checkpointer(workdir, keep=1, save_every=1, asynchronous=asynchronous)
    bad = make_state(3)
    kernel = bad.params["dense"]["kernel"]
    bad = bad.replace(params=bad.params | {"embed": bad.params["embed"].at[3, 1].set(jnp.inf)})
    with pytest.raises(CheckpointWriteError) as e:
        save_verified(ckpt, 3, bad, {})
    assert str(e.value).startswith(
        "state at step 3 has non-finite values (first: .params['embed']); not saved; "
        "the previous checkpoint (step 2) is kept"
    )
    nan = make_state(4).replace(opt_state={"mu": {"k": kernel.at[0, 0].set(jnp.nan)}})
    with pytest.raises(CheckpointWriteError, match=r"first: .opt_state\['mu'\]\['k'\]"):
        save_verified(ckpt, 4, nan, {})
    assert checkpoint_format.list_steps(workdir) == [1, 2]
    assert sorted(os.listdir(ckpt.directory)) == ["1", "2"]
    ckpt.close()


def test_retention_keeps_the_last_and_the_best(tmp_path):
    losses = {1: 0.5, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.95, 6: 0.6}  # the oldest step is the best
    small = {"w": jnp.arange(4.0)}
    ckpt = Checkpointer(str(tmp_path / "run"), keep=2, save_every=1, keep_best=1)
    for step, loss in losses.items():
        assert ckpt.save(step, small, {}, metrics={"loss": loss, "bleu": 10.0 * step})
        assert 1 in ckpt.all_steps()
    assert ckpt.all_steps() == [1, 5, 6]
    assert ckpt.best_step() == 1
    assert ckpt.step_metrics() == {s: {"loss": losses[s], "bleu": 10.0 * s} for s in (1, 5, 6)}
    # Steps saved without metrics are kept by recency alone; a failed save deletes nothing.
    assert ckpt.save(7, small, {})
    assert ckpt.all_steps() == [1, 6, 7]
    with pytest.raises(CheckpointWriteError):
        ckpt.save(8, {"w": jnp.full(4, jnp.nan)}, {})
    assert ckpt.all_steps() == [1, 6, 7]
    ckpt.close()
    # "max": the best is the highest, and two of them are kept.
    by_bleu = dict(keep_best=2, best_metric="bleu", best_mode="max")
    ckpt = Checkpointer(str(tmp_path / "max"), keep=1, save_every=1, **by_bleu)
    for step, bleu in {1: 30.0, 2: 10.0, 3: 20.0, 4: 5.0}.items():
        ckpt.save(step, small, {}, metrics={"bleu": bleu})
    assert ckpt.all_steps() == [1, 3, 4] and ckpt.best_step() == 1
    ckpt.close()


def _mount_tmpfs(path: str, size: str) -> None:
    os.makedirs(path)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
    mount = str(tmp_path / "disk")
    _mount_tmpfs(mount, "1m")
    ckpt = None
    try:
        workdir = os.path.join(mount, "run")
        ckpt = Checkpointer(workdir, keep=1, save_every=1)
        assert ckpt.save(1, STATES[1], {})
        # Fill the disk up to less than the state's size: the next save runs out of space.
        free = shutil.disk_usage(mount).free
        with open(os.path.join(mount, "filler"), "wb") as f:
            f.write(b"\0" * (free - state_nbytes(STATES[2]) // 2))
        with pytest.raises(CheckpointWriteError) as e:
            ckpt.save(2, STATES[2], {})
        text = str(e.value)
        assert text.startswith(f"could not save checkpoint 2 in {ckpt.directory} (")
        assert "No space left on device" in text, text
        assert "the previous checkpoint (step 1) is kept; free disk space" in text
        assert "\n" not in text
        # Nothing of step 2 is left for a resume to pick; step 1 restores as saved.
        assert os.listdir(ckpt.directory) == ["1"]
        assert checkpoint_format.list_steps(workdir) == [1] == ckpt.all_steps()
        reopened = Checkpointer(workdir, keep=1, save_every=1)
        assert reopened.latest_step() == 1
        state, _, step = reopened.restore_latest_good(abstract(STATES[1]))
        assert step == 1
        assert_bitwise_equal(state, STATES[1])
        reopened.close()
        # With space again, the same step saves.
        os.remove(os.path.join(mount, "filler"))
        assert ckpt.save(2, STATES[2], {})
        assert ckpt.all_steps() == [2]
    finally:
        if ckpt is not None:
            ckpt.close()
        subprocess.run(["umount", mount], check=False)


def test_check_writable(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(WorkdirError, match="is not a directory"):
        check_writable(str(a_file / "run"), 0)
    # Root ignores permission bits, but not /proc, where no file can be created.
    with pytest.raises(WorkdirError, match="cannot write checkpoints to /proc/"):
        check_writable("/proc/flaxformer_lite_run", 0)
    workdir = str(tmp_path / "new" / "run")
    check_writable(workdir, 1000)
    assert os.listdir(tmp_path) == ["file"]  # nothing created: the workdir stays new
    need = 2 * state_nbytes(STATES[1])
    assert need == 2 * sum(x.nbytes for x in jax.tree.leaves(STATES[1]))
    assert state_nbytes(abstract(STATES[1])) == need // 2
    usage = shutil.disk_usage(str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1_500_000))
    with pytest.raises(WorkdirError) as e:
        check_writable(workdir, 4_000_000)
    assert str(e.value) == (
        f"workdir {workdir} has 1.5 MB free, but a checkpoint needs about 4.0 MB (twice the "
        "train state, since the previous one is kept until the new one is verified); free "
        "space or pass another --workdir"
    )
    check_writable(workdir, 1_000_000)
