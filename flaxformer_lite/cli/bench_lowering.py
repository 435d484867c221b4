"""What `bench.py --mode lower` runs: the lowering report and the collectives it implies.

The programs are exported for the accelerators from this host (`benchmarks/lowering.py`)
and compiled on a simulated CPU mesh for their collectives.
"""

from __future__ import annotations

import json

from flaxformer_lite.cli import common
from flaxformer_lite.cli.bench import Options


def lower(opts: Options) -> dict:
    """--mode lower: the lowering report of `benchmarks/lowering.py` (before JAX starts its CPU
    backend, which then simulates --lower_devices devices for the collectives)."""
    import jax

    from flaxformer_lite.benchmarks import hlo_report, lowering
    from flaxformer_lite.benchmarks.lowering_programs import PROGRAMS

    f = opts.flags
    unknown = sorted(set(f.lower_programs) - set(PROGRAMS))
    if unknown:
        common.fail(
            f"--lower_programs: unknown program(s) {', '.join(unknown)}; "
            f"known: {', '.join(PROGRAMS)}"
        )
    jax.config.update("jax_num_cpu_devices", f.lower_devices)
    names = tuple(f.lower_programs) or tuple(PROGRAMS)
    print(f"lowering for {', '.join(lowering.PLATFORMS)} from a {jax.default_backend()} host:")
    results = lowering.run(names)
    out = {"lowered": [lowering.as_dict(r) for r in results], "collectives": []}
    print(
        f"collectives on {jax.device_count()} simulated {jax.default_backend()} devices "
        "(the partitioning is the same on every platform):"
    )
    for name, mesh in lowering.TRAFFIC:
        if f.lower_programs and name not in f.lower_programs:
            continue
        t = lowering.traffic(name, mesh)
        for line in lowering.traffic_lines(t):
            print(line)
        for platform in lowering.PLATFORMS:  # the accelerators' kernels on the same mesh
            r = lowering.lower(name, platform, mesh)
            print(f"    {platform} on this mesh: " + ("lowered" if r.ok else r.error))
        out["collectives"].append(
            {
                "program": name,
                "mesh": t.mesh,
                "bytes": hlo_report.summary(t.collectives),
                "bytes_in_loop": hlo_report.summary(t.collectives, in_loop=True),
                "activation_bytes": sum(c.nbytes for c in t.activations),
                "involuntary_remats": len(t.remat_warnings),
            }
        )
    if f.json:
        with open(f.json, "w") as file:
            json.dump(out, file, indent=2)
    failed = [f"{r.program}/{r.platform}" for r in results if not r.ok]
    if failed:
        common.fail(f"{len(failed)} program(s) did not lower: {', '.join(failed)}", code=1)
    return out
