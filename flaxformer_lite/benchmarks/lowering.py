"""What the library's programs become on a GPU or a TPU, checked from a CPU-only host.

Every program a user runs (the train step in its variants, the searches, NAT
decoding, forced scoring; built in `lowering_programs.py`) is exported with
`jax.export` for "cuda" and "tpu": tracing under `kernels.target(platform)` picks the
kernels those platforms would run, so the exported StableHLO holds the same custom
calls (cuDNN flash attention, the Pallas splash kernels) and matmul dtypes as a run
there. From the module text this reports, per program and platform:

  lowered    whether export succeeded (else the first line of the error);
  kernels    the custom calls (cuDNN targets, Pallas kernel names);
  fp32       matmuls (`dot_general`) whose operands are both float32 in a bf16 run,
             each named by its place in the model; the few that are float32 by design
             (`FP32_BY_DESIGN`) are listed apart, with the reason.

`traffic` compiles a program on a simulated N-device CPU mesh (the process must
start with `--xla_force_host_platform_device_count=N`) and lists its collectives by
size (`hlo_report`): XLA's SPMD partitioner is the same on every platform, so the
collectives a sharding implies show here. What needs a GPU: whether cuDNN accepts a
given shape at compile time (the export only proves the call is emitted; JAX's probes
of the local cuDNN are answered by `cudnn_probe` while lowering, as on an H100/H200
with cuDNN 9), and every timing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator

import jax

from flaxformer_lite.benchmarks import hlo_report
from flaxformer_lite.benchmarks.lowering_programs import PROGRAMS
from flaxformer_lite.nn import kernels

PLATFORMS = ("cuda", "tpu")

# Float32 x float32 matmuls that stay so in a bf16 run, by the name-stack fragment that
# identifies them, and why.
FP32_BY_DESIGN = {
    "length_logits": "NAT length classifier: [B, D] x [D, classes] on the float32 mean "
    "of the encoder outputs, a few kFLOPs per example",
    "bts,bsr->btr": "copy loss: attention mass summed over repeated source pieces, a "
    "product of probabilities kept in float32 (bf16 would round the small copy mass)",
    "btk,bnk->btn": "CTC loss (optax.ctc_loss): each label's log-probability picked from "
    "[B, T, V] by a float32 one-hot matmul, B*T*N*V multiply-adds; a loss stays float32",
    "bn,bn->b": "CTC loss (optax.ctc_loss): the final lattice states picked by a one-hot "
    "product, [B, N] per row",
    "hsd,hsd->hs": "splash backward (Pallas library code): the row sums of dO * O over "
    "the head dim, a float32 reduction the kernels take as input",
}


@dataclasses.dataclass
class Matmul:
    operands: tuple[str, str]  # element types, e.g. ("bf16", "f32")
    result: str
    where: str  # the name stack of the op

    @property
    def fp32(self) -> bool:
        return self.operands == ("f32", "f32")

    def by_design(self) -> str | None:
        for key, why in FP32_BY_DESIGN.items():
            if key in self.where:
                return why
        return None


@dataclasses.dataclass
class Lowered:
    program: str
    platform: str
    ok: bool
    error: str = ""
    kernels: tuple[str, ...] = ()
    matmuls: tuple[Matmul, ...] = ()
    kernel_operands: tuple[str, ...] = ()  # operand types of each attention kernel call

    @property
    def fp32_matmuls(self) -> list[Matmul]:
        return [m for m in self.matmuls if m.fp32 and m.by_design() is None]

    @property
    def fp32_by_design(self) -> list[Matmul]:
        return [m for m in self.matmuls if m.fp32 and m.by_design() is not None]


# --- lowering -------------------------------------------------------------------------


@contextlib.contextmanager
def cudnn_probe() -> Iterator[None]:
    """Answers JAX's probes of the local cuDNN and GPU as an H100/H200 with cuDNN 9 would,
    so cuDNN attention lowers on a host without one. No effect where JAX lacks them."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        yield
        return
    stubs = {
        "check_cudnn_version": lambda *a, **k: 91000,
        "check_compute_capability": lambda *a, **k: True,
        "is_cuda_compute_capability_equal": lambda *a, **k: False,
    }
    saved = {n: getattr(fused, n) for n in stubs if hasattr(fused, n)}
    try:
        for n in saved:
            setattr(fused, n, stubs[n])
        yield
    finally:
        for n, f in saved.items():
            setattr(fused, n, f)


def export_text(fn: Callable, args: tuple, platform: str, mesh=None, in_shardings=None) -> str:
    """The StableHLO text (with locations) of `fn(*args)` exported for `platform`; with
    `mesh`, traced under it with the arguments sharded by `in_shardings`."""
    jax.clear_caches()  # jit caches traces without the kernel target in the key
    probe = cudnn_probe() if platform == "cuda" else contextlib.nullcontext()
    on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    jitted = jax.jit(fn) if mesh is None else jax.jit(fn, in_shardings=in_shardings)
    checks = []
    with kernels.target({"cuda": "gpu"}.get(platform, platform)), probe, on_mesh:
        if mesh is not None:
            # jax.export cannot serialize a sharded cuDNN call (its partitioning rule is a
            # Python callback): the same lowering, without serialization.
            lowered = jitted.trace(*args).lower(lowering_platforms=(platform,))
            return lowered.as_text(debug_info=True)
        for _ in range(2):
            try:
                exported = jax.export.export(jitted, platforms=[platform], disabled_checks=checks)(
                    *args
                )
                break
            except ValueError as e:
                # cuDNN's custom calls carry no serialization-compatibility guarantee (a
                # saved module may not load under another cuDNN); they lower all the same.
                names = sorted(set(re.findall(r"(__cudnn\$\w+)", str(e))))
                if not names or checks:
                    raise
                checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in names]
    return exported.mlir_module()


_DOT = re.compile(
    r"stablehlo\.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)> "
    r"loc\((#loc\d+)\)"
)
_LOC = re.compile(r'^(#loc\d+) = loc\("([^"]*)"')
_CUSTOM = re.compile(r"stablehlo\.custom_call @([\w$.]+)")
_KERNEL_NAME = re.compile(r'kernel_name = "(\w+)"')


def _etype(tensor: str) -> str:
    return tensor.rsplit("x", 1)[-1] if "x" in tensor else tensor


def parse(text: str) -> tuple[tuple[str, ...], tuple[Matmul, ...]]:
    """(custom calls and Pallas kernel names, matmuls) of a StableHLO module's text."""
    locs = dict(m.groups() for m in map(_LOC.match, text.splitlines()) if m)
    calls = set(_CUSTOM.findall(text)) - {"tpu_custom_call"}
    calls |= {f"pallas:{n}" for n in _KERNEL_NAME.findall(text)}
    matmuls = tuple(
        Matmul((_etype(a), _etype(b)), _etype(r), locs.get(loc, loc))
        for a, b, r, loc in _DOT.findall(text)
    )
    return tuple(sorted(calls)), matmuls


def lower(name: str, platform: str, mesh_shape: dict[str, int] | None = None) -> Lowered:
    """Exports one program for one platform and reads its kernels and matmuls; with
    `mesh_shape` (e.g. {"fsdp": 8}; needs that many local devices), sharded on that mesh
    by the library's rules."""
    from flaxformer_lite.parallel import partitioning

    try:
        fn, args, shardings = PROGRAMS[name].build()
        if mesh_shape is None:
            text = export_text(fn, args, platform)
        elif shardings is None:
            raise ValueError(f"{name} runs on one device: it has no sharded lowering")
        else:
            mesh = partitioning.make_mesh(
                fsdp=mesh_shape.get("fsdp", 1), model=mesh_shape.get("model", 1)
            )
            text = export_text(fn, args, platform, mesh, shardings(mesh))
    except Exception as e:  # noqa: BLE001 - the report names what failed to lower
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Lowered(name, platform, False, error=f"{type(e).__name__}: {first[:300]}")
    calls, matmuls = parse(text)
    return Lowered(
        name, platform, True, kernels=calls, matmuls=matmuls, kernel_operands=_operands(text)
    )


def _operands(text: str) -> tuple[str, ...]:
    """The operand types of each fused-attention custom call (one device's shapes)."""
    found = []
    for line in text.splitlines():
        if "stablehlo.custom_call" in line and ("tpu_custom_call" in line or "__cudnn" in line):
            m = re.search(r": \((.*?)\) ->", line)
            if m:
                found.append(m.group(1))
    return tuple(found)


def report_lines(result: Lowered) -> list[str]:
    """The printed lines of one program on one platform."""
    head = f"{result.program:18s} {result.platform:5s}"
    if not result.ok:
        return [f"{head} NOT LOWERED  {result.error}"]
    kernels_ = ", ".join(result.kernels) or "none"
    lines = [
        f"{head} lowered  matmuls {len(result.matmuls)}, fp32 x fp32 "
        f"{len(result.fp32_matmuls)} (+{len(result.fp32_by_design)} by design)  "
        f"custom calls: {kernels_}"
    ]
    for m in result.fp32_matmuls:
        lines.append(f"    fp32 matmul: {m.where}")
    seen = set()
    for m in result.fp32_by_design:
        why = m.by_design()
        if why not in seen:
            seen.add(why)
            lines.append(f"    fp32 by design: {why}")
    return lines


# --- collectives on a simulated mesh ---------------------------------------------------


@dataclasses.dataclass
class Traffic:
    """The collectives of one program partitioned on a mesh."""

    program: str
    mesh: dict[str, int]
    collectives: list  # hlo_report.Collective
    param_sizes: set[int]  # every parameter's element count, whole and per device
    remat_warnings: list[str]

    def param_shaped(self, c) -> bool:
        """Whether a collective moves (a piece of) a parameter, moment or gradient: one
        of their sizes, whole or one device's piece (XLA may merge their axes, as the
        stacked Q/K/V kernel's [D, N, 3, H] into [D, 3NH])."""
        return math.prod(c.shape) in self.param_sizes

    @property
    def activations(self) -> list:
        """Collectives of anything but parameter-shaped arrays and scalars (> 64 bytes)."""
        return [c for c in self.collectives if not self.param_shaped(c) and c.nbytes > 64]


def traffic(name: str, mesh_shape: dict[str, int]) -> Traffic:
    """Compiles one program for this host's devices, its arguments sharded on a mesh of
    `mesh_shape` (e.g. {"fsdp": 8}; the data axis takes the remaining devices) by the
    library's rules (`parallel/partitioning.py`), and reads its collectives and XLA's
    involuntary-rematerialization warnings. Needs as many devices as the mesh (on a CPU:
    `jax.config.update("jax_num_cpu_devices", n)` before JAX starts)."""
    from flaxformer_lite.parallel import partitioning

    fn, args, shardings = PROGRAMS[name].build()
    mesh = partitioning.make_mesh(fsdp=mesh_shape.get("fsdp", 1), model=mesh_shape.get("model", 1))
    in_shardings = shardings(mesh)
    jax.clear_caches()
    with hlo_report.capture_compile_log() as log, jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=in_shardings).lower(*args).compile()
    sizes = set()
    for leaf, sharding in zip(jax.tree.leaves(args[0]), jax.tree.leaves(in_shardings[0])):
        sizes |= {math.prod(leaf.shape), math.prod(sharding.shard_shape(leaf.shape))}
    return Traffic(
        name,
        dict(mesh.shape),
        hlo_report.collectives(compiled.as_text()),
        sizes,
        hlo_report.remat_warnings(log[0]),
    )


def traffic_lines(t: Traffic) -> list[str]:
    """The printed lines of one program's collectives."""
    mesh = " x ".join(f"{k}={v}" for k, v in t.mesh.items() if v > 1) or "1 device"
    loop = hlo_report.summary(t.collectives, in_loop=True)
    lines = [
        f"{t.program:18s} {mesh}: "
        + (
            ", ".join(
                f"{k} {v / 2**20:.2f} MiB" for k, v in hlo_report.summary(t.collectives).items()
            )
            or "no collectives"
        )
        + (f"; inside the loop: {loop}" if loop else ""),
        f"    activation collectives: {len(t.activations)} "
        f"({sum(c.nbytes for c in t.activations) / 2**20:.2f} MiB); "
        f"involuntary rematerializations: {len(t.remat_warnings)}",
    ]
    for c in sorted(t.activations, key=lambda c: -c.nbytes)[:3]:
        lines.append(f"    {c.kind} {c.dtype}{list(c.shape)} {'loop' if c.in_loop else ''}")
    return lines


def as_dict(result: Lowered) -> dict:
    """One result as JSON-ready values."""
    return {
        "program": result.program,
        "platform": result.platform,
        "lowered": result.ok,
        "error": result.error,
        "custom_calls": list(result.kernels),
        "matmuls": len(result.matmuls),
        "fp32_matmuls": [m.where for m in result.fp32_matmuls],
        "fp32_by_design": sorted({m.by_design() for m in result.fp32_by_design}),
    }


def run(
    names: tuple[str, ...] | None = None,
    platforms: tuple[str, ...] = PLATFORMS,
    log: Callable[[str], None] = print,
) -> list[Lowered]:
    """Lowers every program (or `names`) for every platform and logs the report."""
    results = []
    for name in names or tuple(PROGRAMS):
        for platform in platforms:
            result = lower(name, platform)
            results.append(result)
            for line in report_lines(result):
                log(line)
    return results


# What the collectives report compiles by default: the train step with parameters
# sharded over 8 devices, and the searches with the batch split 8 ways.
TRAFFIC = (("train_full", {"fsdp": 8}), ("greedy", {}), ("beam", {}))
