"""Which checkpoint decoding reads: latest, a step number, best, latest-good; decode.py --step."""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from test_decode_cli import run_decode

from flaxformer_lite.config.run import parse
from flaxformer_lite.training import checkpoint_format, restore
from flaxformer_lite.training.workdir import CHECKPOINT_DIR

# A failed orbax read or write leaves its unfinished coroutines to the garbage collector.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

LOSSES = {10: 0.5, 20: 0.9}  # validation losses: the earlier step is the best


def edit_meta(workdir, step, edit) -> None:
    path = os.path.join(workdir, CHECKPOINT_DIR, str(step), "meta", "metadata")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump(edit(meta), f)


def with_metrics(metrics, metric="loss", mode="min"):
    return lambda meta: meta | {"metrics": metrics, "best_metric": metric, "best_mode": mode}


def truncate_arrays(workdir, step) -> None:
    """Empties every data file of the step's state. (Decoding reads the parameters alone,
    a third of the state: cut at half its size, a file may still hold all of them whole,
    and the step is then rightly used.)"""
    pattern = os.path.join(workdir, CHECKPOINT_DIR, str(step), "state", "ocdbt.*")
    paths = glob.glob(os.path.join(pattern, "d", "*"))
    assert paths, pattern
    for path in paths:
        os.truncate(path, 0)


def tree_listing(workdir) -> list[tuple[str, int]]:
    """(path, size) of every file under `workdir`."""
    paths = [os.path.join(root, n) for root, _, names in os.walk(workdir) for n in names]
    return sorted((os.path.relpath(p, workdir), os.path.getsize(p)) for p in paths)


def same_bits(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in pairs)


@pytest.fixture(scope="module")
def workdir(tfds_dir, tmp_path_factory):
    """A tiny trained workdir (checkpoints 10 and 20) whose checkpoints carry validation
    metrics, as `Checkpointer.save(..., metrics=...)` writes them."""
    from flaxformer_lite.training import loop

    path = str(tmp_path_factory.mktemp("steps") / "run")
    loop.train_and_evaluate(parse(tiny_config(tfds_dir, num_steps=20)), path, log=lambda s: None)
    for step, loss in LOSSES.items():
        edit_meta(path, step, with_metrics({"loss": loss, "bleu": loss * 10}))
    return path


@pytest.fixture
def copy(workdir, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(workdir, path)
    return path


def test_step_specs(workdir):
    assert restore.resolve_step(workdir, None) == restore.resolve_step(workdir, "latest") == 20
    assert restore.resolve_step(workdir, "10") == restore.resolve_step(workdir, 10) == 10
    assert restore.resolve_step(workdir, "best") == 10
    assert restore.resolve_step(workdir, "latest-good") == 20
    best, _ = restore.restore_params(workdir, "best")
    assert same_bits(best, restore.restore_params(workdir, 10)[0])
    for bad in ("nonsense", "-1", "1.5", "", True):
        with pytest.raises(restore.StepSpecError, match="pass latest, latest-good, best, or a"):
            restore.resolve_step(workdir, bad)
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 15 .* steps: 10, 20"):
        restore.resolve_step(workdir, "15")


def test_best_follows_the_saved_metric_and_needs_one(copy):
    for step, loss in LOSSES.items():  # ranked by BLEU, higher is better: step 20
        edit_meta(copy, step, with_metrics({"loss": loss, "bleu": loss * 10}, "bleu", "max"))
    assert restore.resolve_step(copy, "best") == 20
    for step in LOSSES:
        edit_meta(copy, step, lambda m: {k: v for k, v in m.items() if k != "metrics"})
    with pytest.raises(restore.StepSpecError) as e:
        restore.resolve_step(copy, "best")
    assert str(e.value).endswith(
        "has no checkpoint with validation metrics; train with train.eval_every > 0, or pass "
        "--step latest"
    )


def test_latest_good_skips_a_corrupted_step_and_moves_nothing(copy):
    truncate_arrays(copy, 20)
    before = tree_listing(copy)
    warnings = []
    params, _ = restore.restore_params(copy, "latest-good", log=warnings.append)
    assert same_bits(params, restore.restore_params(copy, 10)[0])
    directory = os.path.join(copy, CHECKPOINT_DIR)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"warning: checkpoint 20 in {directory} is unusable (")
    assert warnings[0].endswith("); using step 10")
    assert restore.resolve_step(copy, "latest-good", log=warnings.append) == 10
    assert tree_listing(copy) == before  # decoding never changes a workdir
    truncate_arrays(copy, 10)
    with pytest.raises(checkpoint_format.CheckpointIntegrityError, match="steps 20, 10 are all"):
        restore.resolve_step(copy, "latest-good", log=warnings.append)


def test_cli_step_flag(copy):
    truncate_arrays(copy, 20)
    before = tree_listing(copy)
    args = ("--workdir", copy, "--step", "latest-good", "--beam_size", "1")
    done = run_decode(*args, stdin=b"en 12\n")
    err = done.stderr.decode()
    assert done.returncode == 0, err[-3000:]
    assert len(done.stdout.decode().splitlines()) == 1
    warnings = [line for line in err.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and "checkpoint 20" in warnings[0] and "using step 10" in warnings[0]
    assert tree_listing(copy) == before
    done = run_decode("--workdir", copy, "--step", "nonsense", stdin=b"en 12\n")
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines() == [
        "error: --step 'nonsense' is not a checkpoint: pass latest, latest-good, best, or a step "
        "number"
    ]
