"""Records the calls of one SparseSplitConv2D (bias + relu, 3x3 SAME) on an
input without zeros, for tests/test_conv2d_dense_warmup.py (with
``--sparsity 0.5 --plain --interleave``: zeros scattered i.i.d., no bias
or activation, the forced instances called alternately, for
tests/test_conv2d_side_hold.py).

In one process: an op instance with the automatic threshold called
``--auto`` times (its calibration and every call's path and part seconds,
parsed from the ops' VLOG lines, as tests/data/record_retime.py does), then
a second instance forced all-dense (threshold 0) and a third forced
all-sparse (threshold 1), ``--forced`` calls each (their part seconds from
the statistics). Run it with the VLOG level on and append the result to the
JSON file's "recordings":

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=split_runtime=2 \\
      python tests/data/record_conv_warmup.py 32x28x28x1x16 out.json \\
      "description" [--auto 30 --forced 60 --seed 0] [--sparsity 0.5 --plain --interleave]
"""

import argparse
import io
import json
import os
import re
import sys
import tempfile


def _calibration(line):
    head = line.split("| rows ", 1)[1].split(" | terms", 1)[0]
    nums = [float(v) for v in re.findall(r"[-+]?\d[\d.]*(?:e[-+]?\d+)?", head)]
    keys = ("rows_full", "rows_part", "nnz_full", "nnz_thin", "nnz_part",
            "dense_full_s", "dense_part_s", "sparse_full_s", "sparse_thin_s",
            "sparse_part_s", "copy_elems", "copy_s")
    return dict(zip(keys, nums))


def _calls(lines):
    out = []
    for line in lines:
        if " call family " not in line:
            continue
        tok = line.split(" call family ", 1)[1].split()
        f = {tok[i]: tok[i + 1] for i in range(len(tok) - 1)}
        out.append({"rows_dense": int(f["rows_dense"]),
                    "rows_sparse": int(f["rows_sparse"]),
                    "dense_s": float(f["dense_s"]),
                    "sparse_s": float(f["sparse_s"]),
                    "analyze_s": float(f.get("analyze_s", "nan")),
                    "retimed": f["retimed"] == "true",
                    "dense_recorded": f["dense_recorded"] == "true"})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("conv", help="NxHxWxC_inxC_out")
    p.add_argument("out")
    p.add_argument("description")
    p.add_argument("--auto", type=int, default=30)
    p.add_argument("--forced", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparsity", type=float, default=0.0,
                   help="fraction of exact zeros, scattered i.i.d. (default "
                        "0: none)")
    p.add_argument("--interleave", action="store_true",
                   help="call the forced instances alternately, not one "
                        "after the other")
    p.add_argument("--plain", action="store_true",
                   help="the convolution alone (no bias, no activation)")
    a = p.parse_args(argv)
    n, h, w, ci, co = (int(v) for v in a.conv.split("x"))
    # The VLOG lines go to fd 2: capture it in a file while the op runs.
    log = tempfile.TemporaryFile(mode="w+")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        import numpy as np
        import tensorflow as tf
        import tf_sparse_split as tfss
        from tf_sparse_split.tuning import stats as S

        rng = np.random.default_rng(a.seed)
        x = rng.standard_normal((n, h, w, ci)).astype(np.float32)
        if a.sparsity > 0.0:
            x[rng.random(x.shape) < a.sparsity] = 0.0
        x = tf.constant(x)
        f = tf.constant((rng.standard_normal((3, 3, ci, co)) /
                         np.sqrt(9 * ci)).astype(np.float32))
        b = tf.constant(rng.standard_normal(co).astype(np.float32))

        def make():
            if a.plain:
                return tf.function(lambda x, f, b, t: tfss.sparse_split_conv2d(
                    x, f, 1, "SAME", threshold=t, full_stats=False,
                    return_stats=True)[1])
            return tf.function(lambda x, f, b, t: tfss.sparse_split_conv2d(
                x, f, 1, "SAME", threshold=t, full_stats=False, bias=b,
                activation="relu", return_stats=True)[1])

        auto = make()
        for _ in range(a.auto):
            auto(x, f, b, tf.constant(-1.0)).numpy()
        forced = {}
        if a.interleave:
            # Both forced instances call by call (dense, sparse, dense, ...):
            # the two paths' seconds under the same load.
            fns = {"dense": (make(), 0.0), "sparse": (make(), 1.0)}
            st = {"dense": [], "sparse": []}
            for _ in range(a.forced):
                for name, (fn, t) in fns.items():
                    st[name].append(fn(x, f, b, tf.constant(t)).numpy())
        else:
            st = {}
            for name, t in (("dense", 0.0), ("sparse", 1.0)):
                fn = make()
                st[name] = [fn(x, f, b, tf.constant(t)).numpy()
                            for _ in range(a.forced)]
        for name in ("dense", "sparse"):
            forced[name] = [float(s[S.TIME_DENSE if name == "dense"
                                    else S.TIME_SPARSE]) for s in st[name]]
    finally:
        os.dup2(saved, 2)
    log.seek(0)
    lines = log.read().splitlines()
    cal = [_calibration(l) for l in lines if " calibration family " in l]
    rec = {"description": a.description, "conv": [n, h, w, ci, co],
           "sparsity": a.sparsity, "plain": a.plain,
           "interleaved": a.interleave,
           "calibration": cal[0], "auto_calls": _calls(lines)[:a.auto],
           "forced_dense_s": forced["dense"],
           "forced_sparse_s": forced["sparse"]}
    data = {"recordings": []}
    if os.path.exists(a.out):
        with open(a.out) as fh:
            data = json.load(fh)
    data["recordings"].append(rec)
    with open(a.out, "w") as fh:
        json.dump(data, fh, indent=1)
    print(json.dumps({k: rec[k] for k in ("conv", "calibration")}))
    print("auto paths:", "".join("D" if c["rows_dense"] else "S"
                                 for c in rec["auto_calls"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
