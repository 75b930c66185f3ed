"""Loading the op library: a damaged or missing library gives a
LibraryLoadError naming what is wrong and the rebuild command (and the
package import itself still succeeds), the build records the library's
size and SHA-256, and an unbuilt source tree that shadows the installed
package gets the advice to run from another directory."""

import os
import shutil
from pathlib import Path

import pytest
from _helpers import run_python

import tf_sparse_split as tfss

PKG = Path(tfss.__file__).resolve().parent


def _package_copy(tmp_path, damage):
    dst = tmp_path / "site"
    shutil.copytree(PKG, dst / "tf_sparse_split",
                    ignore=shutil.ignore_patterns("__pycache__"))
    lib = next((dst / "tf_sparse_split").glob("_sparse_split_ops*.so"))
    data = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(data[: len(data) // 3])
    elif damage == "garbage":
        lib.write_bytes(b"\x00garbage" * 1000)
    elif damage == "wrong_hash":  # same size, one byte flipped in the middle
        i = len(data) // 2
        lib.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif damage == "missing":
        lib.unlink()
    return dst


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong_hash",
                                    "missing"])
def test_damaged_library_gives_library_load_error(tmp_path, damage,
                                                 op_library):
    site = _package_copy(tmp_path, damage)
    r = run_python("""
        import tf_sparse_split as tfss          # must not fail
        import tensorflow as tf
        assert isinstance(tfss.library_error, tfss.LibraryLoadError)
        try:
            tfss.sparse_split_matmul(tf.ones([2, 2]), tf.ones([2, 2]))
        except tfss.LibraryLoadError as e:
            print("ERROR:", e)
        """, cwd=str(tmp_path), env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "ERROR:" in r.stdout
    expect = {"truncated": "damaged", "garbage": "not an ELF",
              "wrong_hash": "SHA-256", "missing": "not built"}[damage]
    assert expect in r.stdout
    assert "pip install --no-build-isolation" in r.stdout


def test_build_info_records_the_library(op_library):
    from tf_sparse_split import _loader

    info = _loader.build_info()
    path = _loader.library_path()
    assert info["LIB_SIZE"] == os.path.getsize(path)
    assert len(info["LIB_SHA256"]) == 64
    _loader.check_library_file(path)


# -- source-tree shadowing ----------------------------------------------------
def test_source_tree_shadowing_gives_the_right_advice(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(PKG, clone / "tf_sparse_split", ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "_build_info.py"))
    (clone / "setup.py").write_text("# the checkout\n")
    installed = tmp_path / "site" / "tf_sparse_split"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    r = run_python("""
        import tf_sparse_split as tfss
        try:
            tfss.load_library()
        except tfss.LibraryLoadError as e:
            print("ERROR:", e)
        """, cwd=str(clone), env={"PYTHONPATH": str(installed.parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unbuilt source tree" in r.stdout
    assert "another directory" in r.stdout
    assert "--force-reinstall" not in r.stdout
