"""Evidence, version 2: pool bench_evidence.py results per domain, tabulate every arm and the paired differences.

For each domain, the runs of every given results file (same evaluation sequences: their bases must agree) are pooled.
Per arm: the chosen lr (the file's sweep winner; usaf_defaults has none: the plan's lr test), mean ± std over seeds
of the in-domain held-out test PPL and the pretraining-domain PPL (forgetting), trainable parameters; then, paired by
seed, each arm minus the reference (``--reference``: usaf at its defaults). Writes one JSON and prints markdown
tables for docs/BENCHMARKS.md.

    python benchmarks/evidence_v2.py --domain torch-cpp benchmarks/results/evidence-v2-*-torch-cpp.json \
        --out benchmarks/results/evidence-v2-torch-cpp-summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REFERENCE = "usaf_defaults_attention"  # usaf at its defaults since the targets default to the experts and attention


def same_sequences(a: dict, b: dict) -> bool:
    """The same evaluation sequences: equal token counts, and the 4-bit base's PPL within 0.1 % (a file made on
    another CPU or an older usaf quantizes within float rounding of another)."""
    x, y = a["hqq4"]["indomain_heldout"], b["hqq4"]["indomain_heldout"]
    return x["tokens"] == y["tokens"] and abs(x["ppl"] - y["ppl"]) <= 1e-3 * y["ppl"]


def chosen_runs(paths: list[Path]) -> tuple[dict, dict]:
    """``{arm: {seed: run}}`` at each file's chosen lr, and the first file's bases."""
    out: dict = {}
    bases = None
    for path in paths:
        r = json.loads(path.read_text())
        bases = bases or r["bases"]
        if not same_sequences(r["bases"], bases):
            raise SystemExit(f"{path}: other evaluation sequences than the first file's")
        for run in r["runs"]:
            if run["lr"] == r.get("chosen_lr", {}).get(run["arm"]):
                out.setdefault(run["arm"], {})[run["seed"]] = run
    return out, bases


def summarize(arms: dict, reference: str = REFERENCE) -> dict:
    table = {}
    for arm, by_seed in arms.items():
        runs = [by_seed[s] for s in sorted(by_seed)]
        row = {
            "lr": [r["learning_rates"].get("deltas") or r["learning_rates"].get("all") or r["lr"] for r in runs],
            "seeds": sorted(by_seed),
            "trainable_params": runs[0]["trainable_params"],
        }  # fmt: skip
        for key, name in (("indomain_heldout", "test"), ("pretrain_heldout", "forgetting")):
            values = [r["eval"][key]["ppl"] for r in runs]
            row[name] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "values": values}  # fmt: skip
        ref = arms.get(reference, {})
        row["minus_defaults"] = {
            name: [by_seed[s]["eval"][key]["ppl"] - ref[s]["eval"][key]["ppl"] for s in sorted(by_seed) if s in ref]
            for key, name in (("indomain_heldout", "test"), ("pretrain_heldout", "forgetting"))
        }
        table[arm] = row
    return table


def print_table(domain: str, bases: dict, table: dict, reference: str = REFERENCE) -> None:
    b = bases["hqq4"]
    print(f"\n{domain}: 4-bit base test {b['indomain_heldout']['ppl']:.2f}, "
          f"forgetting {b['pretrain_heldout']['ppl']:.2f}")
    print("| arm | lr | trainable | held-out test PPL | pretraining PPL (forgetting) "
          f"| − {reference}, by seed (test; forgetting) |")
    print("|---|---|---|---|---|---|")
    for arm, row in sorted(table.items(), key=lambda kv: kv[1]["test"]["mean"]):
        lrs = sorted(set(row["lr"]))
        d = row["minus_defaults"]
        diffs = " / ".join(f"{x:+.2f}" for x in d["test"]) + "; " + " / ".join(f"{x:+.2f}" for x in d["forgetting"])
        print(f"| {arm} | {', '.join(f'{x:g}' for x in lrs)} | {row['trainable_params']:,} | "
              f"{row['test']['mean']:.2f} ± {row['test']['std']:.2f} | "
              f"{row['forgetting']['mean']:.2f} ± {row['forgetting']['std']:.2f} | "
              f"{diffs if arm != reference else '—'} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--domain", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", default=REFERENCE, help=f"the arm paired differences are taken to [{REFERENCE}]")
    args = parser.parse_args()
    arms, bases = chosen_runs(args.results)
    table = summarize(arms, args.reference)
    args.out.write_text(json.dumps({"domain": args.domain, "files": [str(p) for p in args.results], "bases": bases,
                                    "table": table}, indent=1) + "\n")  # fmt: skip
    print_table(args.domain, bases, table, args.reference)


if __name__ == "__main__":
    main()

