"""The length sweep on a tiny encoder: every row and field, the skip rule, and the memory growth
(XLA's estimate: local attention about doubles per doubling, full about quadruples)."""

import numpy as np
import pytest

from flaxformer_lite.benchmarks import length_sweep

TINY = length_sweep.sweep_config(
    input_features=4, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1
)


@pytest.fixture(scope="module")
def rows():
    return length_sweep.length_sweep([128, 256, 512], 8, config=TINY, repeats=1, max_run_mib=4.0)


def test_rows_have_every_field(rows):
    assert [r["length"] for r in rows] == [128, 256, 512]
    for row in rows:
        assert set(row) == set(length_sweep.FIELDS)
        for kind in ("full", "local"):
            assert row[f"{kind}_mib"] > 0
            # Timed exactly where the estimate is under the run limit.
            assert (row[f"{kind}_ms"] is None) == (row[f"{kind}_mib"] > 4.0)
    assert rows[0]["full_growth"] is None and rows[0]["local_growth"] is None
    assert rows[-1]["full_ms"] is None  # 2 heads x 512^2 float32 scores alone are 2 MiB
    table = length_sweep.format_table(rows).splitlines()
    assert len(table) == 1 + len(rows) and "skipped" in table[-1]


def test_local_memory_grows_linearly_and_full_faster(rows):
    for prev, row in zip(rows, rows[1:], strict=False):
        assert row["local_growth"] == pytest.approx(row["local_mib"] / prev["local_mib"])
        assert row["local_growth"] < 2.5
        assert row["full_growth"] > 3.0
    assert np.all(np.diff([r["local_mib"] for r in rows]) > 0)
