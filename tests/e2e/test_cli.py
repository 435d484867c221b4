"""The command-line tools end to end, in subprocesses, as a user runs them."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def run(*args, cwd=ROOT, timeout=300):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_train_cli_end_to_end_and_resume(tfds_dir, tmp_path):
    workdir = str(tmp_path / "run")
    args = (
        "train.py",
        "--config",
        "configs/tiny.py",
        "--workdir",
        workdir,
        f"--config.data.tfds_dir={tfds_dir}",
    )
    first = run(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    final = dict(kv.split("=") for kv in first.stdout.strip().splitlines()[-1].split())
    assert final["step"] == "20"
    assert "test_exact_match" in final
    assert "held-out test examples" in first.stderr
    for name in ("run_config.json", "vocab.spm", "metrics.jsonl", "tensorboard", "checkpoints"):
        assert os.path.exists(os.path.join(workdir, name)), name
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20"]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert {r["split"] for r in records} == {"train", "validation", "test"}

    # Longer run in the same workdir resumes from step 20 instead of starting over.
    second = run(*args, "--config.train.num_steps=30")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 20" in second.stderr
    assert "step=30" in second.stdout


def test_dry_run_base_config_prints_total():
    result = run("train.py", "--config", "configs/wmt14_ende_base.py", "--dry_run", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "total_params=63143936"  # 61,440 of them vocabulary padding
    assert any(line.startswith("shared_embedding") and "37120, 512" in line for line in lines)


# One train.py per way a mistake reaches the user: an unknown key, a value the flag parser
# rejects, a ConfigError from validation, a missing file, a field that moved. The validation
# messages themselves are checked in process (tests/e2e/test_configs.py for train.*,
# tests/unit/data/test_registry.py and test_names.py for data.names.*).
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--config.model.num_layers=2"], "unknown config key 'model.num_layers'"),
        (["--config.data.names.train=x"], "invalid literal"),
        (["--config.model.d_model=30"], "not divisible by model.num_heads"),
        (["--config=configs/nope.py"], "does not exist"),
        (["--config.data.names_train=5"], "has no field 'names_train' (it is now data.names."),
    ],
)
def test_bad_config_gets_one_line(flags, words):
    result = run("train.py", "--dry_run", *flags, timeout=120)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], result.stderr
    assert "Traceback" not in result.stderr


def test_foreign_workdir_gets_one_line_and_is_kept(tmp_path):
    (tmp_path / "thesis.tex").write_text("do not touch")
    result = run("train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: workdir")
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == ["thesis.tex"]
