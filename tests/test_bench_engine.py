"""``experiments.bench_engine``'s cheap parts: how its figures are rounded for the JSON line and the table
(the measurements themselves are the benchmark's, not the suite's)."""

from experiments.bench_engine import rounded, shown


def test_small_figures_keep_their_significant_digits():
    """A log-prob mismatch of 0.00118 (the demo's SFT policy, FP8 engine) is neither 0.001 nor, at 0.000158
    (bfloat16), zero; ratios and counts keep 3 decimals."""
    assert [rounded(x) for x in (0.0011836, 0.000158, 1.9689, 0.5912, 18432.0, 0.0)] == [
        0.00118, 0.000158, 1.969, 0.591, 18432.0, 0.0]
    assert [shown(x) for x in (0.0011836, 0.000158, 1.9689, 18432.0, 0.0)] == [
        "0.0012", "0.00016", "1.97", "18432.00", "0.00"]
