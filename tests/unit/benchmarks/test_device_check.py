"""The accelerator check runs every stage end to end (on this CPU, small shapes)."""

import pytest

from flaxformer_lite.benchmarks import device_check


@pytest.mark.slow
def test_every_stage_runs_on_the_cpu_profile():
    lines = []
    results = device_check.run("cpu", log=lines.append)
    stages = ("environment", "kernel", "memory", "peak", "train_base", "train_big", "decode")
    assert all("error" not in results[s] for s in stages), [results[s] for s in stages]
    assert results["train_base"]["torch_over_ours"] > 0
    assert set(results["goals"].values()) == {"not applicable on this platform"}
    assert any(line.startswith("[decode] batch") for line in lines)
