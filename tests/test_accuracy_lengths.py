"""Rows whose length is only a cap (`seq_len_kind = upper-bound`) are summarised apart.

Their tiers price the cap while their batches were shorter, so pooling them with exact rows
would hide both errors; the table says what pricing them would need instead.
"""

from __future__ import annotations

import pandas as pd

from hybridmem.learned.accuracy import UPPER_BOUND_NEEDS, accuracy, markdown


def rows_and_predictions():
    # two exact rows predicted 10 % under, two upper-bound rows predicted 20 % over (hand-made)
    rows = pd.DataFrame({
        "experiment": ["e1", "e2", "u1", "u2"], "torch_version": "2.7.0",
        "seq_len_kind": ["exact", "exact", "upper-bound", "upper-bound"],
        "peak_reserved_bytes": [100.0, 200.0, 100.0, 200.0]})
    pred = pd.DataFrame({"reserved": [90.0, 180.0, 120.0, 240.0]})
    return rows, {"analytic": pred}


def test_upper_bound_rows_are_never_pooled_with_exact_rows():
    rows, preds = rows_and_predictions()
    acc = accuracy(rows, preds)
    every = acc.table[acc.table["group"] == "all"].set_index("lengths")
    assert sorted(every.index) == ["exact", "upper-bound"]
    assert every.loc["exact", "n"] == 2 and every.loc["exact", "median_signed"] == -10.0
    assert every.loc["upper-bound", "n"] == 2 and every.loc["upper-bound", "median_signed"] == 20.0
    assert list(acc.errors["lengths"]) == ["exact", "exact", "upper-bound", "upper-bound"]
    assert any("2 row(s) are upper-bound" in n and "--lengths FILE" in n for n in acc.notes)


def test_markdown_labels_them_and_says_what_pricing_them_needs():
    rows, preds = rows_and_predictions()
    text = markdown(accuracy(rows, preds).table)
    assert "| reserved peak | analytic | all | upper bound |" in text
    assert "| reserved peak | analytic | all | exact |" in text
    assert text.endswith(UPPER_BOUND_NEEDS)


def test_a_dataset_without_the_column_is_all_exact():
    rows, preds = rows_and_predictions()
    acc = accuracy(rows.drop(columns="seq_len_kind"), preds)
    assert set(acc.table["lengths"]) == {"exact"} and not acc.notes
    assert UPPER_BOUND_NEEDS not in markdown(acc.table)
