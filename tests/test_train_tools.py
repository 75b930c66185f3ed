"""`train --strategy/--tensorboard/--plot` and `profile --end-to-end`."""

import glob
import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_sparse_split.tools.cli import main
from tf_sparse_split.tools.latency import (convert_to_sparse_split,
                                          end_to_end_latency)
from tf_sparse_split.tuning.tuner import HISTOGRAM_TAG, SCALAR_TAGS

pytestmark = pytest.mark.usefixtures("op_library")

SMALL = ["--epochs", "2", "--hidden", "32,32", "--batch-size", "64"]


def _tags(log_dir):
    tags = set()
    for f in glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True):
        for event in tf.compat.v1.train.summary_iterator(f):
            tags.update(v.tag for v in event.summary.value)
    return tags


def test_train_compare_tensorboard_and_plot(tmp_path, capsys):
    png, tb = tmp_path / "train.png", tmp_path / "tb"
    assert main(["train", *SMALL, "--compare", "--quiet", "--plot", str(png),
                 "--tensorboard", str(tb), "--split-all-layers",
                 "--timing-rounds", "2", "--timing-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"plot: {png}" in out and "speed-up" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 600
    assert img.std() > 0.01                      # not a blank canvas
    tags = _tags(tb)
    for layer in ("hidden_1", "hidden_2", "output"):
        for tag in SCALAR_TAGS + (HISTOGRAM_TAG,):
            assert f"{layer}/{tag}" in tags


@pytest.mark.slow
def test_train_mirrored_strategy_with_checkpoints(tmp_path, capsys):
    assert main(["train", *SMALL, "--strategy", "mirrored", "--quiet",
                 "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "sparse-split: test accuracy" in out
    reloaded = keras.saving.load_model(tmp_path / "ckpt" / "model.keras")
    assert [l.name for l in reloaded.layers] == ["hidden_1", "hidden_2",
                                                 "output"]


def test_plot_rejects_non_png(tmp_path, capsys):
    assert main(["train", *SMALL, "--quiet", "--plot",
                 str(tmp_path / "x.jpg")]) == 2   # before training
    assert "PNG" in capsys.readouterr().err


def test_multi_worker_without_tf_config_is_an_error(capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert main(["train", *SMALL, "--strategy", "multi-worker"]) == 1
    assert "TF_CONFIG" in capsys.readouterr().err


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
def test_two_workers_on_loopback_agree(tmp_path):
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}}),
            CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tf_sparse_split", "train",
             "--strategy", "multi-worker", "--epochs", "1", "--hidden",
             "32,32", "--batch-size", "128", "--checkpoint-dir",
             str(tmp_path / f"ckpt{i}"), "--tensorboard",
             str(tmp_path / f"tb{i}")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-3000:]

    def pick(text, prefix):
        lines = [l for l in text.splitlines() if l.startswith(prefix)]
        assert lines, f"no {prefix!r} line in:\n{text[-3000:]}"
        return lines[-1]

    for prefix in ("weights sha256:", "thresholds:", "sparse-split: final loss"):
        assert pick(outs[0], prefix).split(" time/epoch")[0] == \
            pick(outs[1], prefix).split(" time/epoch")[0], prefix
    assert "2 replica(s) in sync" in outs[0]
    # Only the chief (worker 0) writes checkpoints and logs.
    assert (tmp_path / "ckpt0" / "model.keras").is_file()
    assert not (tmp_path / "ckpt1").exists()
    assert "hidden_2/threshold" in _tags(tmp_path / "tb0")
    assert not (tmp_path / "tb1").exists()


def _plain_mlp(path):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu", name="d1"),
        keras.layers.Dense(128, activation="relu", name="d2"),
        keras.layers.Dense(10, activation="softmax", name="d3"),
    ])
    model.save(path)
    return model


def test_convert_to_sparse_split_keeps_outputs(tmp_path):
    model = _plain_mlp(tmp_path / "m.keras")
    converted, names = convert_to_sparse_split(model)
    assert names == ["d1", "d2", "d3"]
    x = np.maximum(np.random.default_rng(0).standard_normal((16, 64)), 0)
    np.testing.assert_allclose(converted(x).numpy(), model(x).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_profile_end_to_end(tmp_path, capsys):
    path = str(tmp_path / "m.keras")
    _plain_mlp(path)
    x = np.maximum(np.random.default_rng(1).standard_normal((32, 64)),
                   0).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["profile", path, "--end-to-end", "--input",
                 str(tmp_path / "x.npy"), "--repeats", "5"]) == 0
    out = capsys.readouterr().out
    for word in ("plain", "rewrite", "sparse-split", "p50 ms", "p90 ms",
                 "MatMul x"):
        assert word in out, out
    res = end_to_end_latency(path, batch_size=16, rounds=4)
    names = [v["name"] for v in res["variants"]]
    assert names == ["plain", "rewrite", "sparse-split"]
    assert res["rewritten"].get("MatMul", 0) >= 2
    for v in res["variants"]:
        assert len(v["times_ms"]) == 4 and v["p50_ms"] <= v["p90_ms"]
        assert v["max_abs_diff"] < 1e-5
    assert res["variants"][0]["ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        end_to_end_latency(path, inputs=np.zeros((4, 3), np.float32))
