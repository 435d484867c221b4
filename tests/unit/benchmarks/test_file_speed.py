"""bench.py --mode files: its timing alternates, its outputs are decode.py's, bad entries fail."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from flaxformer_lite.benchmarks import file_speed
from flaxformer_lite.cli import decode as decode_cli
from flaxformer_lite.translate.line_io import InputError

LINES = ["en 12", "de 45", "", "en 7", "de 3", "en 99"]


def test_alternate_times_every_run_in_turn_after_an_untimed_pass():
    calls, now = [], [0.0]

    def clock():
        return now[0]

    def run_of(label, cost):
        def run(batch):
            calls.append((label, batch))
            now[0] += cost * batch
            return f"{label}@{batch}"

        return run

    runs = {"a": run_of("a", 1.0), "b": run_of("b", 3.0)}
    timed = file_speed.alternate(runs, (1, 2), repeats=3, clock=clock)
    per_batch = [("a", 1), ("b", 1)] * 4 + [("a", 2), ("b", 2)] * 4  # 1 untimed + 3 timed
    assert calls == per_batch
    assert timed["a", 2].samples == [2.0] * 3 and timed["b", 1].seconds == 3.0
    assert timed["b", 2].output == "b@2"  # the untimed pass's output


def test_parse_entry_reads_label_workdir_and_typed_settings():
    entry = file_speed.parse_entry("beam4=/w/a:b/at:beam_size=4,alpha=0.8,step=best")
    assert entry == file_speed.Entry(
        "beam4", "/w/a:b/at", (("beam_size", 4), ("alpha", 0.8), ("step", "best"))
    )
    assert file_speed.parse_entry("ctc=/w/c:t") == file_speed.Entry("ctc", "/w/c:t")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("/w/at", "write LABEL=WORKDIR"),
        ("x=/w/at:beams=4", "unknown setting 'beams=4'; one of beam_size="),
        ("x=/w/at:beam_size=four", "beam_size='four' is not int"),
    ],
)
def test_bad_entry_specs_name_the_fix(spec, message):
    with pytest.raises(InputError, match=message):
        file_speed.parse_entry(spec)


def test_entries_decode_py_refuses_fail_before_restoring(trained_tiny, tmp_path):
    at = file_speed.Entry
    cases = [
        ([at("mp", trained_tiny, (("iterations", 2),))], "--files_entry mp: --iterations applies"),
        ([at("g", str(tmp_path / "none"))], "--files_entry g: workdir .* does not exist"),
        ([at("g", trained_tiny), at("g", trained_tiny)], "label 'g' is given twice"),
        ([at("g", trained_tiny, (("step", "7"),))], "no checkpoint for --step 7"),
    ]
    for entries, message in cases:
        with pytest.raises(InputError, match=message):
            file_speed.open_entries(entries)


def test_outputs_are_decode_py_outputs(trained_tiny, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n")
    entries = [
        file_speed.parse_entry(f"greedy={trained_tiny}:beam_size=1"),
        file_speed.parse_entry(f"beam2={trained_tiny}:beam_size=2,alpha=0.8,step=40"),
    ]
    decoders = file_speed.open_entries(entries, log=lambda s: None)
    rows, outputs = file_speed.measure(decoders, LINES, LINES, batch_sizes=(1, 4), repeats=1)
    for entry in entries:
        for batch in (1, 4):
            out = tmp_path / f"{entry.label}{batch}.txt"
            options = dict(entry.options, input=str(source), output=str(out), batch_size=batch)
            decode_cli.run(decode_cli.Options(workdir=trained_tiny, **options))
            assert outputs[entry.label, batch] == out.read_text().split("\n")[:-1]
    assert [(r["label"], r["batch"]) for r in rows] == [
        ("greedy", 1), ("beam2", 1), ("greedy", 4), ("beam2", 4)
    ]  # fmt: skip
    for row in rows:
        assert row["sentences"] == 5 and row["sentences_per_s"] > 0
        assert 0 <= row["bleu"] <= 100 and 0 <= row["repeated"] <= 1


def test_cli_bad_entry_is_one_error_line(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("en 1\n")
    args = ["--mode=files", f"--files_input={source}", "--files_entry=x=/w:beams=4"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "bench.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: --files_entry x: unknown")
