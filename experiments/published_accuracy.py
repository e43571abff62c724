"""Accuracy of every tier on the published real-GPU rows -> docs/accuracy.md and README.

    python experiments/published_accuracy.py [--data datasets/published] [--no-write]

Prices every row's spec with the analytic and trace tiers (trace answers cached, see
hybridmem.learned.tier_rows), cross-validates the hybrid residual by configuration, and writes
the summary table between the `accuracy:published` markers of README.md and docs/accuracy.md,
plus docs/accuracy-published.json (the numbers; tests/test_accuracy_docs.py checks that the
README shows exactly them and that the analytic rows still hold for the code as it is).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from doc_block import replace_block  # noqa: E402

START, END = "<!-- accuracy:published:start -->", "<!-- accuracy:published:end -->"


def main(argv: list[str] | None = None) -> int:
    from hybridmem.learned.accuracy import markdown
    from hybridmem.learned.compare import tier_accuracy
    from hybridmem.learned.tier_rows import fingerprint

    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT / "datasets" / "published"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    def progress(tier, i, n, name):
        print(f"  {tier}: {i}/{n} {name}", file=sys.stderr, flush=True)

    acc = tier_accuracy(args.data, tiers=("analytic", "trace"), progress=progress)
    table = markdown(acc.table)
    print(table)
    for note in acc.notes:
        print("note:", note)
    worst = (acc.errors.dropna(subset=["error_pct"])
             .assign(abs=lambda d: d["error_pct"].abs())
             .sort_values("abs", ascending=False).head(8))
    print(worst[["figure", "tier", "group", "experiment", "torch_version", "error_pct"]]
          .to_string(index=False))
    if not args.no_write:
        (ROOT / "docs" / "accuracy-published.json").write_text(json.dumps({
            "data": "datasets/published", "tier_fingerprint": fingerprint(),
            "table": acc.table.to_dict("records"), "notes": acc.notes}, indent=1) + "\n")
        for path in (ROOT / "README.md", ROOT / "docs" / "accuracy.md"):
            replace_block(path, table, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
