"""The notebooks are committed executed (outputs from a real run) and still
run without errors (nbclient, a fresh kernel each)."""

import time
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.usefixtures("op_library"), pytest.mark.slow]

nbclient = pytest.importorskip(
    "nbclient", reason="nbclient/ipykernel are in requirements-test.txt")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXECUTED = ["01_quickstart.ipynb", "02_rewrite_and_profile.ipynb", "03_cnn_sensitivity_dropout.ipynb",
            "04_benchmarks.ipynb"]


@pytest.mark.parametrize("name", EXECUTED)
def test_committed_with_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and [c.execution_count for c in code] == \
        list(range(1, len(code) + 1)), "run all cells in order, then save"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "stream" and o.name == "stdout"
               for o in outputs)
    assert any("image/png" in o.get("data", {}) for o in outputs), \
        "every notebook here shows at least one plot"


@pytest.mark.parametrize("name", EXECUTED)
def test_executes_without_errors(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()          # raises CellExecutionError on any error
    elapsed = time.perf_counter() - start
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    print(f"{name}: {elapsed:.1f} s")
