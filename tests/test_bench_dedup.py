"""The dedup benchmark's scoring (benchmarks/bench_dedup.py): by the truth's survivor, and with any one survivor
a duplicate group, which is how a peer that keeps a later copy is judged fairly."""

from __future__ import annotations

import pytest

from benchmarks.bench_dedup import quality

# d0 <- near0 (J 0.9); chain A < B < C: B and C go (B's Jaccard to A is below 0.8, it goes through C);
# d1 <- exact0; near1 was planted below 0.8 and is not judged.
TRUTH = {"go": {"near0": ("d0", 0.9), "chainB0": ("chainA0", 0.75), "chainC0": ("chainA0", 0.86),
                "exact0": ("d1", 1.0)}, "unplanned": ["near1"]}


def test_removing_exactly_the_planted_copies_is_perfect_both_ways():
    assert quality({"near0", "chainB0", "chainC0", "exact0", "near1"}, TRUTH) == (1.0, 1.0, 1.0, 1.0)


def test_a_later_survivor_counts_only_with_any_survivor():
    # a peer keeps chain B and removes A and C, misses near0, removes d2 (no duplicate of anything)
    recall, precision, any_recall, any_precision = quality({"chainA0", "chainC0", "exact0", "d2"}, TRUTH)
    assert (recall, precision) == (2 / 4, 2 / 4)
    assert (any_recall, any_precision) == (3 / 4, 3 / 4)


def test_a_whole_group_removed_is_one_too_many():
    recall, precision, any_recall, any_precision = quality({"d1", "exact0"}, TRUTH)
    assert (recall, precision) == pytest.approx((1 / 4, 1 / 2))
    assert (any_recall, any_precision) == pytest.approx((1 / 4, 1 / 2))
