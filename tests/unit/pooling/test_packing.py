"""Texts into packed rows (pooling/packing.py): first-fit decreasing, the row length chosen by the calls' cost, the
rows' inputs and each text's share of the padding. Plain arithmetic: no model."""

from __future__ import annotations

import torch

from neuron_serve.pooling import packing


def linear(compiled, per_token=1.0, per_call=0.0):
    """A cost of rows x length tokens (plus a fixed cost a call), each row its own call."""
    return lambda bucket, rows: rows * (compiled[bucket] * per_token + per_call)


def test_first_fit_decreasing_fills_rows_exactly_and_keeps_the_texts_per_row_limit():
    lengths = [40, 24, 64, 10, 3, 3]
    rows = packing.first_fit_decreasing(lengths, range(len(lengths)), 64, most=32)
    assert rows == [[2], [0, 1], [3, 4, 5]]  # 64 alone, 40 + 24 fill a row exactly, the rest share one
    assert packing.first_fit_decreasing([1] * 5, range(5), 64, most=2) == [[0, 1], [2, 3], [4]]


def test_the_plan_packs_short_texts_into_few_rows_and_a_long_text_into_the_bucket_holding_it():
    compiled = [16, 64]
    lengths = [50, *[5] * 6]
    # In rows of 16: the six short texts in two rows of 16 (three a row), the 50-token text in a row of 64.
    chosen = packing.plan(lengths, compiled, linear(compiled), most=32)
    assert [(p.length, p.rows) for p in chosen] == [(16, ((1, 2, 3), (4, 5, 6))), (64, ((0,),))]
    # Rows of 64 when a call's fixed cost makes one row of everything cheaper than three calls.
    chosen = packing.plan(lengths, compiled, linear(compiled, per_call=100.0), most=32)
    assert [(p.length, len(p.rows)) for p in chosen] == [(64, 2)]
    # One text alone runs in its own bucket, as it would unpacked.
    assert [(p.length, p.rows) for p in packing.plan([9], compiled, linear(compiled), most=32)] == [(16, ((0,),))]


def test_a_longer_row_measured_cheaper_than_a_shorter_one_is_not_taken_for_it():
    """Costs are measured with noise: a text alone stays in its own bucket even when the longer one timed faster."""
    measured = {0: 9.0, 1: 5.0}  # the 64-token row timed faster than the 16-token one
    chosen = packing.plan([9], [16, 64], lambda bucket, rows: rows * measured[bucket], most=32)
    assert [(p.length, p.rows) for p in chosen] == [(16, ((0,),))]


def test_one_segment_a_row_is_the_padded_layout():
    chosen = packing.plan([5, 5, 30], [16, 64], linear([16, 64]), most=1)
    assert [(p.length, p.rows) for p in chosen] == [(16, ((0,), (1,))), (64, ((2,),))]


def test_a_rows_inputs_number_its_texts_and_the_padding_shares_add_up():
    packed = packing.Rows(8, ((0, 1), (2,)))
    ids = [[101, 7, 102], [101, 8, 9, 102], [101, 102]]
    types = [[0, 0, 0], [0, 0, 1, 1], [0, 0]]
    tokens, segments, token_types = packing.tensors(packed, ids, types, ("input_ids", "attention_mask",
                                                                         "token_type_ids"), pad_token_id=0)
    assert tokens.tolist() == [[101, 7, 102, 101, 8, 9, 102, 0], [101, 102, 0, 0, 0, 0, 0, 0]]
    assert segments.tolist() == [[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert token_types.tolist() == [[0, 0, 0, 0, 0, 1, 1, 0], [0] * 8]
    assert tokens.dtype == torch.int64
    shares = packing.padding_shares(packed, [3, 4, 2])
    assert shares == {0: 1, 1: 0, 2: 6} and sum(shares.values()) == 2 * 8 - 9
