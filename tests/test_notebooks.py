"""The quick-start notebook is valid nbformat 4 and its code runs."""

import json
from pathlib import Path

import pytest


pytestmark = pytest.mark.usefixtures("op_library")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / \
    "01_quickstart.ipynb"


def _load():
    with open(NOTEBOOK, encoding="utf-8") as f:
        return json.load(f)


def test_notebook_is_nbformat_4():
    nb = _load()
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 4
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    ids = [c["id"] for c in nb["cells"]]
    assert len(set(ids)) == len(ids)
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("markdown", "code")
        assert isinstance(cell["source"], list) and cell["source"]
    text = "".join("".join(c["source"]) for c in nb["cells"])
    for needle in ("SparseSplitDense", "SplitThresholdCallback",
                   "latest_stats", "load_digits"):
        assert needle in text


def test_notebook_code_runs(capsys, tmp_path, monkeypatch):
    import tempfile

    # The notebook's temporary files go here, and must be gone afterwards.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    nb = _load()
    namespace = {"__name__": "__notebook__"}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), str(NOTEBOOK), "exec"),
                 namespace)
    out = capsys.readouterr().out
    assert "reloaded identical: True" in out
    assert namespace["diff"] < 1e-5
    assert len(namespace["callback"].history) == namespace["EPOCHS"]
    assert list(tmp_path.iterdir()) == []  # no .keras file left behind
