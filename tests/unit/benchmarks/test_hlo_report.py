"""The HLO collective report reads what XLA compiled: kinds, shapes, sizes, loop membership."""

import os
import subprocess
import sys

from conftest import ROOT

from flaxformer_lite.benchmarks import hlo_report

# Hand-written optimised HLO in XLA's text format: async pairs, a variadic all-reduce,
# a reduce-scatter wrapped in an async computation, and a while body reached via a fusion.
HLO = """\
HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: bf16[4,16]) -> bf16[32,16] {
  %p = bf16[4,16]{1,0} parameter(0)
  ROOT %all-gather.3 = bf16[32,16]{1,0} all-gather(%p), channel_id=3, dimensions={0}
}

%rs_wrapped (q: f32[64]) -> f32[8] {
  %q = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8]{0} reduce-scatter(%q), dimensions={0}, to_apply=%add
}

%body (t: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {
  %t = (s32[], bf16[4,16]{1,0}) parameter(0)
  %x = bf16[4,16]{1,0} get-tuple-element(%t), index=1
  %f = bf16[32,16]{1,0} fusion(%x), kind=kCustom, calls=%inner
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], bf16[4,16]{1,0}) tuple(%i, %x)
}

%cond (c: (s32[], bf16[4,16])) -> pred[] {
  %c = (s32[], bf16[4,16]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: f32[2,3], y: s32[5], z: bf16[4,16], w: f32[64]) -> f32[2,3] {
  %x = f32[2,3]{1,0} parameter(0)
  %y = s32[5]{0} parameter(1)
  %z = bf16[4,16]{1,0} parameter(2)
  %w = f32[64]{0} parameter(3)
  %ags = (f32[2,3]{1,0}, f32[16,3]{1,0}) all-gather-start(%x), channel_id=1, dimensions={0}
  %agd = f32[16,3]{1,0} all-gather-done(%ags)
  %ar = (f32[2,3]{1,0}, s32[5]{0}) all-reduce(%x, %y), channel_id=2, to_apply=%add
  %as = ((f32[64]{0}), f32[8]{0}) async-start(%w), calls=%rs_wrapped
  %ad = f32[8]{0} async-done(%as)
  %cps = (f32[2,3]{1,0}, f32[2,3]{1,0}, u32[], u32[]) collective-permute-start(%x)
  %cpd = f32[2,3]{1,0} collective-permute-done(%cps)
  %t0 = (s32[], bf16[4,16]{1,0}) tuple(%y, %z)
  %loop = (s32[], bf16[4,16]{1,0}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[2,3]{1,0} copy(%cpd)
}
"""


def test_collectives_of_handwritten_hlo():
    found = {(c.kind, c.shape): c for c in hlo_report.collectives(HLO)}
    assert set(found) == {
        ("all-gather", (16, 3)),  # the -done's result, not the start's tuple
        ("all-reduce", (2, 3)),  # a variadic all-reduce: one entry per operand
        ("all-reduce", (5,)),
        ("reduce-scatter", (8,)),  # inside an async computation
        ("collective-permute", (2, 3)),
        ("all-gather", (32, 16)),  # in a fusion called from the while body
    }
    assert found[("all-gather", (32, 16))].in_loop
    assert found[("all-gather", (32, 16))].dtype == "bf16"
    assert found[("all-gather", (32, 16))].nbytes == 32 * 16 * 2
    assert not any(c.in_loop for k, c in found.items() if k != ("all-gather", (32, 16)))
    assert found[("all-reduce", (5,))].dtype == "s32"
    assert hlo_report.summary(found.values()) == {
        "all-gather": 16 * 3 * 4 + 32 * 16 * 2,
        "all-reduce": 6 * 4 + 5 * 4,
        "reduce-scatter": 8 * 4,
        "collective-permute": 6 * 4,
    }
    assert hlo_report.summary(found.values(), in_loop=True) == {"all-gather": 32 * 16 * 2}


def test_no_collectives_reads_as_none():
    assert hlo_report.collectives("HloModule m\n\nENTRY %e () -> f32[] {\n}\n") == []
    assert hlo_report.format_report([]) == "no collectives"


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from flaxformer_lite.benchmarks import hlo_report
assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("data")))

def f(x):  # a row gather over the split axis inside a loop: the loop all-gathers x
    def body(carry):
        i, y = carry
        return i + 1, jnp.take(y, (jnp.arange(64) + 1) % 64, axis=0) * 1.01
    _, y = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
    return y.sum(0)  # a partial sum per device: one all-reduce, after the loop

found = hlo_report.collectives(jax.jit(f).lower(x).compile().as_text())
print(hlo_report.format_report(found))
kinds = sorted((c.kind, c.shape, c.dtype, c.in_loop) for c in found)
assert kinds == [("all-gather", (64, 32), "f32", True), ("all-reduce", (32,), "f32", False)], kinds

mesh3 = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
def reshard(src, dst):
    z = jax.device_put(jnp.ones((8, 12, 16)), NamedSharding(mesh3, src))
    g = lambda z: jax.lax.with_sharding_constraint(z * 2, NamedSharding(mesh3, dst)) + 1
    with hlo_report.capture_compile_log() as log:
        jax.jit(g).lower(z).compile()
    return hlo_report.remat_warnings(log[0])
# Split rows over (b, a) to a split of the last dim over c: no all-to-all does it.
assert len(reshard(P(("b", "a")), P(None, None, "c"))) == 1
assert reshard(P(("a", "b")), P(None, None, ("b", "c"))) == []  # all-to-alls suffice
print("checked")
"""


def test_collectives_of_a_partitioned_program():
    """8 simulated devices: a loop's all-gather is seen in the loop, the final psum outside,
    and XLA's full-rematerialization warning is caught from its C++ log."""
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
    )
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "checked" in result.stdout
