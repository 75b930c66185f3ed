"""Turns the ops' VLOG lines into a JSON recording of automatic calls.

Run a model with ``TF_CPP_VMODULE=split_runtime=2`` and pass its stderr:

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=split_runtime=2 \\
      python benchmarks/bench_inference.py --models mlp --batches 32 \\
      --out /tmp/x.md 2> /tmp/vlog.txt
    python tests/data/record_retime.py /tmp/vlog.txt out.json

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
                "analysis": float(f["analysis"])})
    return families


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        fams = parse(fh)
    with open(sys.argv[2], "w") as fh:
        json.dump(fams, fh, indent=1)
    for k, v in fams.items():
        calls = [e for e in v["events"] if e["event"] == "call"]
        print(k, len(v["calibrations"]), "calibrations", len(calls), "calls",
              calls[0]["m"] if calls else "", calls[0]["k"] if calls else "")
