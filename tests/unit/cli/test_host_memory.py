"""Reusing freed host memory stops XLA:CPU from mapping fresh scratch pages every run."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, optimised_xla_flags

from flaxformer_lite.cli import host_memory

needs_glibc = pytest.mark.skipif(not host_memory.has_glibc(), reason="needs glibc malloc")

# Allocates, fills and frees one 64 MiB block 30 times through the C library (as XLA:CPU
# does with a program's scratch memory at every run) and prints the minor page faults of
# each of the last 10 rounds. glibc serves a block that large with its own mmap (above its
# dynamic threshold's 32 MiB ceiling), so every round faults all its pages in anew, unless
# reuse keeps freed memory in the heap. The settings are per process: each mode gets its own.
_MALLOC_PROBE = """
import ctypes, json, resource, sys
sys.path.insert(0, {root!r})
from flaxformer_lite.cli import host_memory
applied = host_memory.configure({mode!r})
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
faults = []
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"applied": applied, "faults": sorted(faults[-10:])}}))
"""

# The same through a jitted program whose scratch memory (two 32 MiB intermediates, the
# cumulative sums, which XLA does not fuse away) is one block of 64 MiB. With reuse the
# heap first grows for some runs (small allocations land in the freed block) and then
# settles (here by run ~30), hence the warm-up and the median.
_PROBE = """
import json, resource, sys
sys.path.insert(0, {root!r})
from flaxformer_lite.cli import host_memory
applied = host_memory.configure({mode!r})
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.cumsum(x, axis=0) * jnp.cumsum(x, axis=1)))
x = jnp.ones((2048, 4096), jnp.float32)
for _ in range(40):
    f(x).block_until_ready()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"applied": applied, "faults": sorted(faults)}}))
"""


def _probe(mode: str, probe: str = _PROBE) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", probe.format(root=ROOT, mode=mode)],
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=optimised_xla_flags()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_glibc
def test_reuse_keeps_a_freed_large_block_mapped():
    system, reuse = _probe("system", _MALLOC_PROBE), _probe("reuse", _MALLOC_PROBE)
    assert not system["applied"] and reuse["applied"]
    # 64 MiB of fresh pages is 16384 4-KiB faults (fewer with transparent huge pages).
    assert system["faults"][0] > 2000, system
    assert reuse["faults"][-1] < system["faults"][0] / 20, (system, reuse)


@needs_glibc
@pytest.mark.slow
def test_reuse_removes_the_per_run_page_faults_of_an_xla_program():
    system, reuse = _probe("system"), _probe("reuse")
    assert not system["applied"] and reuse["applied"]
    assert system["faults"][0] > 2000, system
    assert reuse["faults"][5] < system["faults"][0] / 20, (system, reuse)


def test_auto_leaves_malloc_alone_when_an_accelerator_is_expected(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert host_memory.accelerator_expected()
    assert host_memory.configure("auto") is False
    assert not host_memory.applied()  # nothing was set in this process
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not host_memory.accelerator_expected()


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="host_malloc must be one of auto, reuse, system"):
        host_memory.configure("fast")
    assert host_memory.configure("system") is False


def test_cli_names_a_bad_mode_in_one_line():
    result = subprocess.run(
        [sys.executable, "bench.py", "--host_malloc=fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --host_malloc must be one of auto, reuse, system, got 'fast'"
    )
