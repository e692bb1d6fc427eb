"""Buckets from recorded sizes (buckets/traffic.py): the padding of a list, recomputed here by hand, and the list
the proposer returns, checked against every other list of as many buckets."""

from __future__ import annotations

import itertools
import random

from neuron_serve.buckets.traffic import Sizes, bucket_of, padding, per_bucket, propose

COUNTS = {10: 50, 12: 30, 30: 10, 100: 5, 500: 1}


def test_padding_is_the_work_of_the_buckets_that_run_each_size_over_the_sizes_own():
    # 50 x 10 and 30 x 12 run on 32, 10 x 30 on 32, 5 x 100 on 128, 1 x 500 on 512.
    real = 50 * 10 + 30 * 12 + 10 * 30 + 5 * 100 + 500
    done = (50 + 30 + 10) * 32 + 5 * 128 + 512
    assert padding(COUNTS, [32, 64, 128, 256, 512]) == done / real
    # With a call's overhead of 4 units on both sides.
    assert padding(COUNTS, [512], overhead=4) == sum(n * (512 + 4) for n in COUNTS.values()) / \
        sum(n * (size + 4) for size, n in COUNTS.items())
    assert per_bucket(COUNTS, [32, 128, 512])[32] == {"requests": 90, "real": 50 * 10 + 30 * 12 + 300,
                                                      "padded": 50 * 22 + 30 * 20 + 10 * 2}
    assert bucket_of(33, [32, 64]) == 64 and bucket_of(65, [32, 64]) is None


def test_the_proposed_list_pads_least_of_every_list_of_its_size_that_keeps_the_largest():
    proposed = propose(COUNTS, 3, 512)
    assert proposed[-1] == 512 and len(proposed) <= 3
    candidates = sorted(set(COUNTS) | {512})
    best = min(padding(COUNTS, [*pair, 512]) for pair in itertools.combinations(candidates[:-1], 2))
    assert padding(COUNTS, proposed) == best == padding(COUNTS, [12, 100, 512])


def test_a_skewed_distribution_pads_far_less_on_proposed_buckets_than_on_doubling_ones():
    rng = random.Random(0)
    sizes = Sizes()
    for _ in range(5000):  # text lengths of a log-normal mix, as an embedder's inputs are
        sizes.record("tokens", min(256, max(1, int(rng.lognormvariate(3.5, 0.6)))))
    counts = sizes.of("tokens")
    doubling = padding(counts, [32, 64, 128, 256])
    four, twelve = propose(counts, 4, 256), propose(counts, 12, 256)
    assert doubling > 1.48 and padding(counts, four) < 1.46 and padding(counts, twelve) < 1.12
    assert four[-1] == twelve[-1] == 256 and len(twelve) == 12


def test_recorded_sizes_merge_across_replicas_and_survive_a_file(tmp_path):
    one, two = Sizes(), Sizes()
    one.record("prompt", 40, 3)
    two.record("prompt", 40)
    two.record("prompt", 200)
    merged = one.merge([two])
    assert merged.of("prompt") == {40: 4, 200: 1}
    merged.save(tmp_path / "sizes.json")
    assert Sizes.load(tmp_path / "sizes.json").as_dict() == {"prompt": {"40": 4, "200": 1}}
    bounded = Sizes(limit=10)
    for _ in range(11):
        bounded.record("rows", 1)
    assert bounded.total("rows") == 5  # halved once past the limit: older traffic weighs less
