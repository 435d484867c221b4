"""`bench.py` modes that run a trained workdir on a real file: `serve` and `files`."""

from __future__ import annotations

from flaxformer_lite.cli import common


def serve(f, log) -> dict:
    """--mode serve: `benchmarks/serve_load.py` on --serve_input."""
    from flaxformer_lite.benchmarks import serve_load

    return {
        "serve": serve_load.run_file(
            f.serve_workdir,
            f.serve_input,
            clients=f.serve_clients,
            slots=f.serve_slots,
            duration=f.serve_duration,
            log=log,
        )
    }


def files(f, log) -> dict:
    """--mode files: `benchmarks/file_speed.py` on --files_input; one line for a bad flag."""
    from flaxformer_lite.benchmarks import file_speed
    from flaxformer_lite.translate.line_io import InputError

    try:
        batches = [int(b) for b in f.files_batches]
    except ValueError:
        common.fail(f"--files_batches takes positive integers, got {','.join(f.files_batches)}")
    if not f.files_input:
        common.fail("--mode files decodes a file: pass --files_input")
    try:
        entries = [file_speed.parse_entry(spec) for spec in f.files_entry]
        results = file_speed.run_files(
            entries,
            f.files_input,
            f.files_reference,
            batch_sizes=batches,
            repeats=f.repeats,
            limit=f.files_limit,
            log=log,
        )
    except InputError as e:
        common.fail(str(e))
    return {"files": results}
