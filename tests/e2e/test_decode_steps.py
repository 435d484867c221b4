"""Which checkpoint decoding reads: latest, a step number, best, latest-good; decode.py --step."""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import TRAINED_TINY_STEPS
from test_decode_cli import run_decode

from flaxformer_lite.training import checkpoint_format, restore
from flaxformer_lite.training.workdir import CHECKPOINT_DIR

# A failed orbax read or write leaves its unfinished coroutines to the garbage collector.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

BEST, LATEST = TRAINED_TINY_STEPS - 10, TRAINED_TINY_STEPS  # two of its checkpoints
LOSSES = {BEST: 0.5, LATEST: 0.9}  # validation losses: the earlier step is the best


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
def workdir(trained_tiny, tmp_path_factory):
    """A copy of the shared tiny run with two checkpoints (BEST and LATEST) that carry
    validation metrics, as `Checkpointer.save(..., metrics=...)` writes them."""
    path = str(tmp_path_factory.mktemp("steps") / "run")
    shutil.copytree(trained_tiny, path)
    for step in checkpoint_format.list_steps(path):
        if step not in LOSSES:
            shutil.rmtree(os.path.join(path, CHECKPOINT_DIR, str(step)))
    for step, loss in LOSSES.items():
        edit_meta(path, step, with_metrics({"loss": loss, "bleu": loss * 10}))
    return path


@pytest.fixture
def copy(workdir, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(workdir, path)
    return path


def test_step_specs(workdir):
    assert restore.resolve_step(workdir, None) == restore.resolve_step(workdir, "latest") == LATEST
    assert restore.resolve_step(workdir, str(BEST)) == restore.resolve_step(workdir, BEST) == BEST
    assert restore.resolve_step(workdir, "best") == BEST
    assert restore.resolve_step(workdir, "latest-good") == LATEST
    best, _ = restore.restore_params(workdir, "best")
    assert same_bits(best, restore.restore_params(workdir, BEST)[0])
    for bad in ("nonsense", "-1", "1.5", "", True):
        with pytest.raises(restore.StepSpecError, match="pass latest, latest-good, best, or a"):
            restore.resolve_step(workdir, bad)
    between = f"no checkpoint for step {BEST + 5} .* steps: {BEST}, {LATEST}"
    with pytest.raises(FileNotFoundError, match=between):
        restore.resolve_step(workdir, str(BEST + 5))


def test_best_follows_the_saved_metric_and_needs_one(copy):
    for step, loss in LOSSES.items():  # ranked by BLEU, higher is better: LATEST
        edit_meta(copy, step, with_metrics({"loss": loss, "bleu": loss * 10}, "bleu", "max"))
    assert restore.resolve_step(copy, "best") == LATEST
    for step in LOSSES:
        edit_meta(copy, step, lambda m: {k: v for k, v in m.items() if k != "metrics"})
    with pytest.raises(restore.StepSpecError) as e:
        restore.resolve_step(copy, "best")
    assert str(e.value).endswith(
        "has no checkpoint with validation metrics; train with train.eval_every > 0, or pass "
        "--step latest"
    )


def test_latest_good_skips_a_corrupted_step_and_moves_nothing(copy):
    truncate_arrays(copy, LATEST)
    before = tree_listing(copy)
    warnings = []
    params, _ = restore.restore_params(copy, "latest-good", log=warnings.append)
    assert same_bits(params, restore.restore_params(copy, BEST)[0])
    directory = os.path.join(copy, CHECKPOINT_DIR)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"warning: checkpoint {LATEST} in {directory} is unusable (")
    assert warnings[0].endswith(f"); using step {BEST}")
    assert restore.resolve_step(copy, "latest-good", log=warnings.append) == BEST
    assert tree_listing(copy) == before  # decoding never changes a workdir
    truncate_arrays(copy, BEST)
    with pytest.raises(
        checkpoint_format.CheckpointIntegrityError, match=f"steps {LATEST}, {BEST} are all"
    ):
        restore.resolve_step(copy, "latest-good", log=warnings.append)


def test_cli_step_flag(copy):
    truncate_arrays(copy, LATEST)
    before = tree_listing(copy)
    args = ("--workdir", copy, "--step", "latest-good", "--beam_size", "1")
    done = run_decode(*args, stdin=b"en 12\n")
    err = done.stderr.decode()
    assert done.returncode == 0, err[-3000:]
    assert len(done.stdout.decode().splitlines()) == 1
    warnings = [line for line in err.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and f"checkpoint {LATEST}" in warnings[0]
    assert f"using step {BEST}" in warnings[0]
    assert tree_listing(copy) == before
    done = run_decode("--workdir", copy, "--step", "nonsense", stdin=b"en 12\n")
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines() == [
        "error: --step 'nonsense' is not a checkpoint: pass latest, latest-good, best, or a step "
        "number"
    ]
