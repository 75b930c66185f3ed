"""Records calls of the sparse-split ops as JSON, from their VLOG lines.

Parse the stderr of any run with ``TF_CPP_VMODULE=split_runtime=2``:

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=split_runtime=2 \\
      python benchmarks/bench_inference.py --models mlp --batches 32 \\
      --out /tmp/x.md 2> /tmp/vlog.txt
    python tests/data/record_retime.py parse /tmp/vlog.txt out.json "description"

or record both paths of the converted MLP of benchmarks/bench_inference.py
(784-2048-2048-10, 60 Adam steps, one test batch of 32 called again and
again): ``--rounds`` rounds of ``--block`` calls each with every layer's
threshold forced to 0 (all rows dense, compacted by the fixed rule), to 1
(all rows sparse) and automatic (-1), after 3 automatic calls:

    python tests/data/record_retime.py mlp out.json [--rounds 12 --block 5]

(tests/data/mlp_b32_retime_calls.json holds two recordings made this way
and two parsed from bench_inference.py runs, under "recordings".)

Per problem family (the op library's FamilyModel address): its calibration
terms, and in order every automatic call's decision line (shape, terms the
decision used, profile ``bucket:rows:nnz``, decided plan, re-timed or not)
and call line (the path it ran: rows dense/sparse, compaction, nonzeros in
the sparse rows, the parts' seconds).
"""

import json
import re
import sys

_KV = re.compile(r"(\w+) (\S+)")


def _fields(text):
    return dict(_KV.findall(text))


def parse(lines):
    families = {}
    for line in lines:
        i = line.find("tf_sparse_split ")
        if i < 0:
            continue
        body = line[i + len("tf_sparse_split "):].strip()
        what, _, rest = body.partition(" family ")
        if what not in ("calibration", "recalibration", "decide", "call"):
            continue
        fam_id, _, rest = rest.partition(" ")
        fam = families.setdefault(fam_id, {"calibrations": [], "events": []})
        if what in ("calibration", "recalibration"):
            head, _, terms = rest.partition("| terms ")
            nums = [float(x) for x in re.search(
                r"dense (\S+) \+ 1/(\S+) sparse (\S+) \+ (\S+)/elem "
                r"\+ 1/(\S+) copy (\S+)", terms).groups()]
            t = dict(zip(("dense_fixed_s", "dense_rate", "sparse_fixed_s",
                          "convert_s_per_elem", "sparse_rate",
                          "copy_s_per_elem"), nums))
            row_copy = re.search(r" rowcopy (\S+)", terms)
            if row_copy:  # the row-copy term (lines from later builds)
                t["row_copy_s_per_elem"] = float(row_copy.group(1))
            f = _fields(head)
            fam["calibrations"].append(
                {"kind": what, "m": int(f["m"]), "k": int(f["k"]),
                 "k_live": int(f["k_live"]), "terms": t,
                 "at_event": len(fam["events"])})
        elif what == "decide":
            head, _, prof = rest.partition(" profile")
            terms_part = re.search(r"terms (\S+) (\S+) (\S+) (\S+) (\S+) (\S+)",
                                   head).groups()
            dec = re.search(r"decided (\S+) (\S+) (\S+) (\S+)", head).groups()
            f = _fields(head)
            fam["events"].append({
                "event": "decide", "op": f["op"], "m": int(f["m"]),
                "k": int(f["k"]), "k_live": int(f["k_live"]),
                "n": int(float(f["n"])),
                "terms": [float(x) for x in terms_part],
                "decided_kind": int(dec[0]),
                "decided_s": float(dec[1]), "all_dense_s": float(dec[2]),
                "best_sparse_s": float(dec[3]),
                "retimed": f["retimed"] in ("1", "true"),
                "profile": [[int(a), float(b), float(c)] for a, b, c in
                            (x.split(":") for x in prof.split())]})
        else:
            f = _fields(rest)
            fam["events"].append({
                "event": "call", "op": f["op"], "m": int(f["m"]),
                "k": int(f["k"]), "k_live": int(f["k_live"]),
                "rows_dense": int(f["rows_dense"]),
                "rows_sparse": int(f["rows_sparse"]),
                "compact": f["compact"] in ("1", "true"),
                "nnz_sparse": float(f["nnz_sparse"]),
                "dense_s": float(f["dense_s"]),
                "sparse_s": float(f["sparse_s"]),
                "analyze_s": float(f["analyze_s"]),
                "retimed": f["retimed"] in ("1", "true"),
                "analysis": float(f["analysis"]),
                "dense_recorded": f.get("dense_recorded") in ("1", "true")})
    return families


_COLUMNS = ("op", "k_live", "rows_dense", "rows_sparse", "compact",
            "nnz_sparse", "dense_s", "sparse_s", "retimed", "analysis")


def columnar(families):
    """The stored form: per family ``family<i>`` its calibrations, its first
    decision line and its calls column by column (op instances renamed
    ``op<j>``, seconds to 4 significant digits)."""
    out = {}
    for i, fam in enumerate(families.values()):
        ops = {}
        decides = [e for e in fam["events"] if e["event"] == "decide"]
        calls = [e for e in fam["events"] if e["event"] == "call"]
        if not decides:
            continue
        for e in decides + calls:
            e["op"] = ops.setdefault(e["op"], f"op{len(ops)}")
        for e in calls:
            for key in ("dense_s", "sparse_s"):
                e[key] = float("%.4g" % e[key])
        out[f"family{i}"] = {
            "calibrations": fam["calibrations"], "decide": decides[0],
            "calls": {c: [e[c] for e in calls] for c in _COLUMNS}}
    return out


def _record_mlp(rounds, block, batch):
    """Runs in a child whose stderr is the VLOG file (see main)."""
    import os
    import sys as _sys
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "benchmarks"
    _sys.path.insert(0, str(here))
    import numpy as np
    import tensorflow as tf

    import bench_inference as bi
    import tf_sparse_split as tfss
    from _common import load_mnist_or_digits

    tfss.load_library()
    (x, y), (xt, yt), _ = load_mnist_or_digits(None)
    model, _ = bi.train("mlp", x, y, xt, yt, 60, 128, 0)
    conv = bi.convert(model)
    layers = [l for l in conv._flatten_layers(include_self=False, recursive=True)
              if isinstance(l, tfss.SparseSplitLayer)]
    idx = np.random.default_rng(0).choice(len(xt), batch, replace=False)
    xb = tf.constant(xt[idx])
    fn = tf.function(lambda v: conv(v, training=False))

    def run(thr, calls):
        for l in layers:
            l.threshold_var.assign(thr)
        for _ in range(calls):
            fn(xb).numpy()

    run(-1.0, 3)
    for _ in range(rounds):
        for thr in (0.0, 1.0, -1.0):
            run(thr, block)
    os.write(2, b"tf_sparse_split record done\n")


def main(argv):
    import argparse
    import os
    import subprocess
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("parse")
    a.add_argument("vlog")
    a.add_argument("out")
    a.add_argument("description", nargs="*")
    b = sub.add_parser("mlp")
    b.add_argument("out")
    b.add_argument("--rounds", type=int, default=12)
    b.add_argument("--block", type=int, default=5)
    b.add_argument("--batch", type=int, default=32)
    b.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.what == "mlp" and args.child:
        _record_mlp(args.rounds, args.block, args.batch)
        return
    if args.what == "mlp":
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0",
                   TF_CPP_VMODULE="split_runtime=2")
        with tempfile.NamedTemporaryFile("w+", suffix=".vlog") as log:
            subprocess.run([sys.executable, __file__, "mlp", args.out,
                            "--rounds", str(args.rounds), "--block",
                            str(args.block), "--batch", str(args.batch),
                            "--child"], env=env, stderr=log, check=True)
            log.seek(0)
            fams = parse(log)
        # Forced thresholds run without the op's memory (op 0): the MLP's
        # layers are one op each, so they are that family's automatic op.
        for fam in fams.values():
            ops = {e["op"] for e in fam["events"] if e["op"] != "0"}
            assert len(ops) == 1, ops
            for e in fam["events"]:
                e["op"] = next(iter(ops))
        desc = (f"converted MLP 784-2048-2048-10 of bench_inference, batch "
                f"{args.batch}: 3 automatic calls, then {args.rounds} rounds "
                f"of {args.block} calls at threshold 0 (all dense, "
                f"compacted), 1 (all sparse) and automatic")
    else:
        with open(args.vlog) as fh:
            fams = parse(fh)
        desc = " ".join(args.description) or "recorded calls"
    fams = columnar(fams)
    with open(args.out, "w") as fh:
        json.dump({"description": desc, "families": fams}, fh,
                  separators=(",", ":"))
    for k, v in fams.items():
        print(k, len(v["calibrations"]), "calibrations",
              len(v["calls"]["op"]), "calls")


if __name__ == "__main__":
    main(sys.argv[1:])
