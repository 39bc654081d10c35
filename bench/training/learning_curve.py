"""Held-out tau of a training run against the slot-tokens it has trained on: a table and
a PNG, from the run's eval.jsonl (written by ``python -m dflash_ext train --holdout N
--eval-every K``; tau = 1 + mean accepted prefix of blocks drafted at fixed held-out
anchors, from the per-block correctness matrix; drafts are the argmax over the draft
vocabulary where the run has one, as at inference). A run continued from another's weights
(``train --init``) is given as ``PATH+N``: its slot-tokens start at N, the first run's total.

    .venv/bin/python -m bench.training.learning_curve data/train-b16/eval.jsonl data/train-b8/eval.jsonl+4169144 \
        --png bench/results/learning_curve.png

The logs of the shipped drafter's runs are kept in bench/results/training/<run>/eval.jsonl
(the first four transcribed from the tables the script printed then: step, slot-tokens,
tau and P(first 1 / 2 / 4 ok) only, as ``p1``, ``p2``, ``p4``).
"""
import argparse
import json
import os

from bench import _common


def first_ok(row) -> dict:
    """P(first 1 / 2 / 4 drafts accepted) of one eval row: from its profile (``accept[j]`` =
    P(first j+1 ok); a run at B <= 4 has no p4, and B = 2 no p2), or as stored in a
    transcribed log (p1, p2, p4 only)."""
    if "accept" in row:
        accept = row["accept"]
        return {f"p{j}": accept[j - 1] if len(accept) >= j else None for j in (1, 2, 4)}
    return dict(p1=row["p1"], p2=row["p2"], p4=row["p4"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_log", nargs="+", help="eval.jsonl of one or more runs (label = its folder), "
                    "PATH+N for a run that continued after N slot-tokens of another")
    ap.add_argument("--png", default="", help="write the plot here")
    args = ap.parse_args(argv)
    plt = _common.pyplot() if args.png else None
    fig, ax = (plt.subplots(figsize=(7, 4.5)) if plt else (None, None))
    for spec in args.eval_log:
        path, _, offset = spec.partition("+")
        rows = [json.loads(line) for line in open(path) if line.strip()]
        for r in rows:
            r["slot_tokens"] += int(offset or 0)
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
        table = [dict(step=r["step"], slot_tokens=r["slot_tokens"], tau=r["tau"], **first_ok(r)) for r in rows]
        print(_common.format_table(table, [
            ("step", "step", "{}"), ("slot_tokens", "slot-tokens", "{:,}"), ("tau", "held-out tau", "{:.3f}"),
            ("p1", "P(1st draft ok)", "{:.3f}"), ("p2", "P(first 2 ok)", "{:.3f}"), ("p4", "P(first 4 ok)", "{:.3f}")],
            title=f"# {label}: {path}"))
        if ax is not None:
            ax.plot([r["slot_tokens"] / 1e6 for r in rows], [r["tau"] for r in rows], "o-", label=label)
    if ax is not None:
        ax.set_xlabel("trained slot-tokens (millions)")
        ax.set_ylabel("held-out tau (tokens per verify step)")
        ax.set_title("DFlash drafter learning curve (held-out ShareGPT responses of the target)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if _common.save_figure(fig, args.png):
            print(f"# plot written to {args.png}")


if __name__ == "__main__":
    main()
