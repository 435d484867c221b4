"""The platform line of the command-line tools, with a fake `nvidia-smi` on PATH."""

import os
import stat

import jax
import pytest

from flaxformer_lite.cli import common

GPU_LINE = "GPU 0: NVIDIA H200 (UUID: GPU-0000)"


def fake_nvidia_smi(directory, stdout: str, code: int = 0) -> None:
    """An `nvidia-smi` that prints `stdout` and exits with `code`."""
    path = directory / "nvidia-smi"
    path.write_text(f"#!/bin/sh\ncat <<'END'\n{stdout}\nEND\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def report(monkeypatch, tmp_path, backend="cpu", jax_platforms=None):
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    if jax_platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", jax_platforms)
    lines = []
    assert common.report_platform(lines.append) == backend
    assert lines[0] == f"running on {backend}: {jax.device_count()} device(s)"
    return lines[1:]


def test_gpu_visible_but_jax_on_cpu_warns_with_the_fix(monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, GPU_LINE)
    (warning,) = report(monkeypatch, tmp_path)
    assert warning.startswith("warning: JAX runs on the CPU")
    assert GPU_LINE in warning and 'pip install -e ".[cuda12]"' in warning


def test_cpu_forced_by_jax_platforms_names_that_instead(monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, GPU_LINE)
    (warning,) = report(monkeypatch, tmp_path, jax_platforms="cpu")
    assert "unset JAX_PLATFORMS=cpu" in warning and "cuda12" not in warning


@pytest.mark.parametrize(
    "stdout, code",
    [
        ("No devices were found", 6),  # driver present, no GPU
        ("NVIDIA-SMI has failed because it couldn't communicate with the driver", 9),
        ("", 0),
    ],
)
def test_no_warning_without_a_listed_gpu(monkeypatch, tmp_path, stdout, code):
    fake_nvidia_smi(tmp_path, stdout, code)
    assert report(monkeypatch, tmp_path) == []


def test_no_warning_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setattr(common.shutil, "which", lambda name: None)
    assert report(monkeypatch, tmp_path) == []


def test_no_warning_when_jax_uses_the_gpu(monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, GPU_LINE)
    assert report(monkeypatch, tmp_path, backend="gpu") == []
