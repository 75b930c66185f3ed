"""``benchmarks/bench_downstream.py`` end to end on a tiny product: one
table row per first op and next width, the next layer's time after TF's
own kernel as the ratios' reference, finite positive times (what is timed
is not checked: timings belong to the benchmarks)."""

import re

import pytest
from _helpers import import_benchmark

pytestmark = pytest.mark.usefixtures("op_library")


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_downstream")


def test_report_has_a_row_per_first_op_and_next_width(bench, tmp_path):
    out = tmp_path / "downstream.md"
    bench.main(["--batch", "4", "--k", "48", "--n", "32", "--next-n", "16,8",
                "--sparsity", "0.7", "--rounds", "2", "--reps", "1",
                "--warmup", "1", "--out", str(out)])
    text = out.read_text()
    assert "70% zeros" in text
    rows = [line for line in text.splitlines()
            if line.startswith("| 4x48x32 -> ")]
    names = [name for name, _ in bench.FIRSTS]
    assert len(rows) == 2 * len(names)
    for width, block in (("16", rows[:len(names)]), ("8", rows[len(names):])):
        for name, row in zip(names, block):
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[0] == f"4x48x32 -> {width}" and cells[1] == name
            first_ms = float(cells[2])
            assert first_ms > 0
            next_ms, ratio = (float(re.match(r"-?[\d.]+", c).group())
                              for c in cells[3:5])
            assert abs(next_ms) < 1e3 and abs(ratio) < 1e6
        # TensorFlow's own first op is the reference of every ratio.
        assert [c.strip() for c in block[0].strip("|").split("|")][4] \
            .startswith("1.000 (1.00-1.00)")
