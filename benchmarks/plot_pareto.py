"""Pareto plots of the evidence benchmark: in-domain held-out PPL against forgetting, every arm and learning rate.

Reads one or more results files of ``bench_evidence.py`` for the same domain (their runs are pooled, a later file's
rerun of an (arm, size, lr, seed) replacing the earlier; the bases must agree), and draws one point per (arm, lr,
seed) run, faint, plus each arm's mean over seeds at every lr that ran on more than one seed, bold. x: PPL on the
pretraining domain's held-out sources (forgetting; left is better), y: PPL on the fine-tuning domain's held-out test
sample (lower is better). The legend gives each arm's trainable parameters. The 4-bit and original bases are drawn
as crosses.

    python benchmarks/plot_pareto.py benchmarks/results/evidence-torch-cpp.json [more.json ...] \
        --out docs/pareto-torch-cpp.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from evidence_v2 import same_sequences  # the script's directory is on sys.path

FORGETTING_LIMIT = 3.0  # runs forgetting beyond this multiple of the base's pretraining PPL are not drawn


def load_runs(paths: list[Path]) -> tuple[list[dict], dict, str]:
    """The runs of every file, a later file's run of the same arm, size, lr and seed replacing an earlier one (a
    rerun at a newer commit, e.g. usaf's defaults after a change of the lr test)."""
    runs: dict[tuple, dict] = {}
    bases, domain = None, None
    for path in paths:
        r = json.loads(path.read_text())
        d = r["settings"].get("domain", "stdlib-net")
        if domain is not None and d != domain:
            raise SystemExit(f"{path}: domain {d}, the others' {domain}")
        domain = d
        if bases is None:
            bases = r["bases"]
        elif not same_sequences(r["bases"], bases):
            raise SystemExit(f"{path}: other evaluation sequences than the first file's (bases differ)")
        for run in r["runs"]:
            runs[(run["arm"], run.get("trainable_params"), run["lr"], run["seed"])] = run
    return list(runs.values()), bases, domain


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (both lower is better), sorted by x."""
    front = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def plot(runs: list[dict], bases: dict, domain: str, out: Path, exclude: tuple[str, ...] = ()) -> None:
    import matplotlib  # lazy: an optional dependency (usaf[plot])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen
    from matplotlib import ticker  # lazy: with matplotlib

    # Runs that diverged (worse than the base in-domain, or forgetting beyond FORGETTING_LIMIT x the base) would
    # squash the rest of the plot: they are counted in the title instead of drawn.
    base = bases["hqq4"]
    def on_chart(r: dict) -> bool:
        forgetting_limit = FORGETTING_LIMIT * base["pretrain_heldout"]["ppl"]
        e = r["eval"]
        better_than_base = e["indomain_heldout"]["ppl"] <= base["indomain_heldout"]["ppl"]
        return better_than_base and e["pretrain_heldout"]["ppl"] <= forgetting_limit

    by_arm: dict[tuple[str, int], list[dict]] = defaultdict(list)  # an arm at another size is another arm
    off = 0
    for r in runs:
        if r["arm"] in exclude:
            continue
        if not on_chart(r):
            off += 1
            continue
        by_arm[(r["arm"], r["trainable_params"])].append(r)
    fig, ax = plt.subplots(figsize=(9, 6.5))
    cmap = plt.get_cmap("tab20")
    means = []
    for i, ((arm, params), rs) in enumerate(sorted(by_arm.items())):
        color = cmap(i % 20)
        xs = [r["eval"]["pretrain_heldout"]["ppl"] for r in rs]
        ys = [r["eval"]["indomain_heldout"]["ppl"] for r in rs]
        ax.scatter(xs, ys, color=color, alpha=0.25, s=14)
        label = f"{arm} ({params:,} trainable)"
        by_lr: dict[float, list[dict]] = defaultdict(list)
        for r in rs:
            by_lr[r["lr"]].append(r)
        for lr, group in sorted(by_lr.items()):
            x = statistics.fmean(r["eval"]["pretrain_heldout"]["ppl"] for r in group)
            y = statistics.fmean(r["eval"]["indomain_heldout"]["ppl"] for r in group)
            if len(group) > 1:
                ax.scatter([x], [y], color=color, s=60, edgecolor="black", label=label)
                name = "lr test" if lr == 0 else f"{lr:g}"  # lr 0: usaf train took the plan's lr (bench_evidence)
                ax.annotate(f"{name} ×{len(group)}", (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
                label = None
                means.append((x, y))
            else:
                ax.annotate(f"{lr:g}", (x, y), fontsize=6, color=color, xytext=(3, -8), textcoords="offset points")
        if label is not None:  # no lr ran on several seeds: label the faint points
            ax.scatter([], [], color=color, alpha=0.5, s=14, label=label)
    front = pareto_front(means)
    if len(front) > 1:
        ax.plot(*zip(*front), color="grey", linestyle="--", linewidth=1, label="front of the seed means")
    for name, marker in (("hqq4", "X"), ("original_fp32", "P")):
        b = bases[name]
        ax.scatter([b["pretrain_heldout"]["ppl"]], [b["indomain_heldout"]["ppl"]], marker=marker, color="black",
                   s=70, label=f"base: {name}")  # fmt: skip
    ax.set_xlabel("pretraining-domain held-out PPL (forgetting; lower is better)")
    ax.set_ylabel(f"{domain} held-out test PPL (lower is better)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not 4.6 x 10^1
        axis.set_major_formatter(ticker.ScalarFormatter())
        axis.set_minor_formatter(ticker.FormatStrFormatter("%.3g"))  # a narrow range has ticks between integers
    ax.set_title(f"{domain}: every arm and lr (faint: one run, bold: mean over seeds)"
                 + (f"; {off} runs off the chart (worse than the base in-domain, or forgetting > {FORGETTING_LIMIT:g}x)"
                    if off else ""), fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="bench_evidence.py results files of one domain")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--exclude", nargs="*", default=[], help="arms to leave out (e.g. full_finetune)")
    args = parser.parse_args()
    runs, bases, domain = load_runs(args.results)
    plot(runs, bases, domain, args.out, tuple(args.exclude))


if __name__ == "__main__":
    main()

