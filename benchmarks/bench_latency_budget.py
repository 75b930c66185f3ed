"""Inference within a latency budget (``tfss.fit_latency_budget``; R. Sun
and L. Zhang, *Dynamic Sparse Method for Deep Learning Execution*, 2019).

For the MLP 784-2048-2048-10 and the CNN of ``tools/models.py`` (conv
32-64, dense 10), trained briefly with plain Keras layers on MNIST from
``--data`` (or the usual places, else the upsampled digits; the report says
which) and converted with ``tfss.sparse_split_model``:

1. the converted model's p50 latency of one ``--batch`` call at its own
   (ReLU) cutoffs, interleaved with the plain model's (their ratio shows
   what the conversion alone gives);
2. for each budget ``f x`` the converted model's p50 as a search measures
   it (a first search with no binding budget: the original cutoffs' median
   p50 over its rounds) (``--fractions``, default 0.9, 0.75, 0.6): a fresh
   copy of the converted model given to
   ``fit_latency_budget(copy, budget, sample, accuracy_data=test set)``;
   reported: the budget, the chosen point's target sparsity, its p50 and
   whether it meets the budget, its test accuracy against the model's own,
   and the points tried. A PNG of the accuracy/latency curve per model
   (the last budget's points, which are the same ladder) is written beside
   the report.

Every latency is measured on a machine that may be shared: the search
interleaves each point with the original cutoffs, so the ratios hold even
when absolute times move.

  python benchmarks/bench_latency_budget.py [--quick] [--data DIR]
"""

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import _common  # noqa: E402

HERE = Path(__file__).resolve().parent


def _build(case, seed):
    import keras

    from tf_sparse_split.tools import models

    keras.utils.set_random_seed(seed)
    if case == "mlp":
        m = models.build_mlp(784, [2048, 2048], 10, sparse=False)
    else:
        m = models.build_cnn(28, [32, 64], 10, sparse=False)
    m.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"],
              jit_compile=False)
    return m


def _shaped(case, x):
    return x.reshape(-1, 28, 28, 1) if case == "cnn" else x


def run_case(case, args, data):
    import keras
    import tensorflow as tf

    import tf_sparse_split as tfss
    from tf_sparse_split.tools.plots import plot_latency_curve
    from tf_sparse_split.tools.timing import interleaved_blocks

    (x, y), (xt, yt) = data
    x, xt = _shaped(case, x), _shaped(case, xt)
    plain = _build(case, args.seed)
    plain.fit(x[:args.train], y[:args.train], batch_size=128,
              epochs=args.epochs, verbose=0)
    acc_plain = float(plain.evaluate(xt, yt, batch_size=256, verbose=0)[1])
    sample = xt[:args.batch]
    conv = tfss.sparse_split_model(plain)
    f_plain = tf.function(lambda t: plain(t, training=False))
    f_conv = tf.function(lambda t: conv(t, training=False))
    for _ in range(5):
        np.asarray(f_plain(sample)), np.asarray(f_conv(sample))
    # One call per block, the order alternating every round.
    times = interleaved_blocks(
        {"plain": lambda i: np.asarray(f_plain(sample)),
         "ours": lambda i: np.asarray(f_conv(sample))},
        rounds=args.rounds * 2, block=1)
    p_plain, p_conv = (statistics.median(times[k]) for k in ("plain", "ours"))
    # The budgets are fractions of the converted model's p50 as the search
    # itself measures it (a search with no binding budget: the original
    # cutoffs' median p50 over its rounds). A p50 from a separate phase
    # can sit at another machine speed (at batch 1, 2.7 ms before the
    # searches against 1.1-1.5 ms in them), and then every budget is met
    # at the model's own cutoffs or none is.
    probe = keras.models.clone_model(conv)
    probe.set_weights(conv.get_weights())
    ref = tfss.fit_latency_budget(probe, 1e9, sample, rounds=args.rounds)
    p_ref = ref["points"][0]["est_p50_ms"] / 1e3
    rows, last = [], None
    for frac in args.fractions:
        budget = frac * p_ref
        model = keras.models.clone_model(conv)
        model.set_weights(conv.get_weights())
        res = tfss.fit_latency_budget(model, budget, sample,
                                      accuracy_data=(xt, yt),
                                      rounds=args.rounds)
        ch = res["points"][res["chosen"]]
        rows.append({"frac": frac, "budget_ms": budget * 1e3,
                     "target": ch["sparsity"], "p50_ms": ch["p50_ms"],
                     "est_p50_ms": ch["est_p50_ms"],
                     "met": ch["est_p50_ms"] <= budget * 1e3,
                     "reachable": res["reachable"],
                     "accuracy": ch["accuracy"],
                     "tried": len(res["points"])})
        last = res
        print(f"{case} budget {frac:.2f}x = {budget * 1e3:.2f} ms: target "
              f"{ch['sparsity']}, p50 {ch['est_p50_ms']:.2f} ms, acc "
              f"{ch['accuracy']:.4f}", flush=True)
    png = None
    if args.out_dir:
        png = os.path.join(args.out_dir, f"bench_latency_budget_{case}.png")
        plot_latency_curve(last["points"], png, budget_ms=None,
                           chosen=last["chosen"])
    return {"case": case, "acc_plain": acc_plain, "p_plain": p_plain,
            "p_conv": p_conv, "p_ref": p_ref, "rows": rows,
            "points": last["points"],
            "png": png}


def report(results, args, data_desc):
    from tf_sparse_split._loader import build_info

    lines = ["# bench_latency_budget" + (" (--quick)" if args.quick else ""),
             "", f"{_common.tf_machine_desc(build_info())}; data: "
             f"{data_desc}; batch {args.batch}; {args.rounds} timed calls "
             "per point, each alternating with the original cutoffs "
             "(3 untimed calls after each switch); est. p50 = the original "
             "cutoffs' median p50 over the search / the point's interleaved "
             "ratio, which the search checks the budget on.", ""]
    for r in results:
        lines += [f"### {r['case']}", "",
                  f"Plain Keras p50 {r['p_plain'] * 1e3:.2f} ms, converted "
                  f"{r['p_conv'] * 1e3:.2f} ms at its own cutoffs "
                  f"(plain / converted {r['p_plain'] / r['p_conv']:.2f}x); "
                  f"test accuracy {r['acc_plain']:.4f}. The budgets are "
                  f"fractions of the converted p50 the search measured with "
                  f"no binding budget: {r['p_ref'] * 1e3:.2f} ms.", ""]
        head = ("| budget x converted p50 (search) | budget ms | chosen target "
                "sparsity | est. p50 ms (own p50) | met | test accuracy | "
                "points tried |")
        rows = [f"| {x['frac']:.2f} | {x['budget_ms']:.2f} | "
                f"{'own cutoffs' if x['target'] is None else x['target']} | "
                f"{x['est_p50_ms']:.2f} ({x['p50_ms']:.2f}) | "
                f"{'yes' if x['met'] else 'no'} | "
                f"{x['accuracy']:.4f} | {x['tried']} |" for x in r["rows"]]
        lines.append(_common.markdown_table(head, rows))
        head = ("| target sparsity | measured sparsity | p50 ms | "
                "original / point | est. p50 ms | test accuracy |")
        rows = [f"| {p['sparsity'] if p['sparsity'] is not None else 'own'}"
                f" | {p['measured_sparsity']:.3f} | {p['p50_ms']:.2f} | "
                f"{p['ratio']:.2f} | {p['est_p50_ms']:.2f} | "
                f"{p['accuracy']:.4f} |"
                for p in r["points"]]
        lines += ["Points of the last search (the curve):", "",
                  _common.markdown_table(head, rows)]
        if r["png"]:
            lines += [f"Curve: `{os.path.basename(r['png'])}`.", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="MLP only, 1 epoch on 2000 examples, 2 budgets")
    p.add_argument("--data", default=None, help="MNIST IDX directory")
    p.add_argument("--cases", default="mlp,cnn")
    p.add_argument("--fractions", default="0.9,0.75,0.6")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None,
                   help="directory of the report and PNGs (default "
                        "benchmarks/results; --quick: none)")
    args = p.parse_args(argv)
    args.fractions = [float(v) for v in args.fractions.split(",")]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in ("mlp", "cnn"):
            p.error(f"unknown case {c!r} (mlp, cnn)")
    if args.quick:
        cases, args.epochs, args.train = ["mlp"], 1, 2000
        args.fractions, args.rounds = [0.9, 0.6], 5
    elif args.out_dir is None:
        args.out_dir = str(HERE / "results")
    if args.out_dir:   # before the training, not after it
        os.makedirs(args.out_dir, exist_ok=True)
    (x, y), (xt, yt), desc = _common.load_mnist_or_digits(args.data)
    results = [run_case(c, args, ((x, y), (xt, yt))) for c in cases]
    text = report(results, args, desc)
    print(text)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        _common.write_report(os.path.join(args.out_dir,
                                          "bench_latency_budget.md"), text)


if __name__ == "__main__":
    main()
