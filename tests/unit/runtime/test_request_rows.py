"""collate / split: batching arithmetic, no server."""

import pytest
import torch

from neuron_serve.errors import InvalidInput
from neuron_serve.runtime.request_rows import collate, split


def test_collate_concatenates_each_input_and_reports_rows():
    a = [torch.rand(2, 3), torch.arange(2)]
    b = [torch.rand(1, 3), torch.arange(1) + 10]
    batched, sizes = collate([a, b])
    assert sizes == [2, 1]
    torch.testing.assert_close(batched[0], torch.cat([a[0], b[0]]))
    assert batched[1].tolist() == [0, 1, 10]


def test_padding_repeats_the_last_row():
    ids = [[torch.tensor([[1, 2]])], [torch.tensor([[3, 4], [5, 6]])]]
    batched, sizes = collate(ids, pad_to=6)
    assert sizes == [1, 2]
    assert batched[0].tolist() == [[1, 2], [3, 4], [5, 6], [5, 6], [5, 6], [5, 6]]


def test_pad_to_equal_rows_is_a_no_op():
    batched, _ = collate([[torch.ones(3, 2)]], pad_to=3)
    assert batched[0].shape == (3, 2)


def test_pad_to_below_rows_is_refused():
    with pytest.raises(ValueError, match="pad_to=2 is smaller than the 3 rows"):
        collate([[torch.ones(3, 2)]], pad_to=2)


def test_non0_dim_mismatch_names_the_input():
    with pytest.raises(InvalidInput, match=r"input 1 of request 1 has shape \(1, 5\).*request 0 has \(1, 4\)"):
        collate([[torch.ones(1, 2), torch.ones(1, 4)], [torch.ones(1, 2), torch.ones(1, 5)]])


def test_dtype_mismatch_names_the_input():
    with pytest.raises(InvalidInput, match="input 0 of request 1 .* dtype torch.int64"):
        collate([[torch.ones(1, 2)], [torch.ones(1, 2, dtype=torch.long)]])


def test_dim0_mismatch_within_a_request_names_the_input():
    with pytest.raises(InvalidInput, match="input 1 of request 0 has dim 0 = 3 but input 0 has 2"):
        collate([[torch.ones(2, 2), torch.ones(3, 2)]])


def test_input_count_mismatch():
    with pytest.raises(InvalidInput, match="request 1 has 1 inputs but request 0 has 2"):
        collate([[torch.ones(1), torch.ones(1)], [torch.ones(1)]])


def test_scalar_input_and_empty_batch_are_refused():
    with pytest.raises(InvalidInput, match="input 0 of request 0 is a scalar tensor"):
        collate([[torch.tensor(1.0)]])
    with pytest.raises(InvalidInput, match="at least one request"):
        collate([])
    with pytest.raises(InvalidInput, match="request 0 has 0 rows"):
        collate([[torch.ones(0, 2)]])


def test_split_returns_each_requests_rows_and_drops_padding():
    out = torch.arange(7).unsqueeze(1)  # 3 real rows + 4 padding
    parts = split(out, [1, 2])
    assert [p.tolist() for p in parts] == [[[0]], [[1], [2]]]


def test_split_pytree_outputs():
    outputs = {"logits": torch.arange(4), "pair": (torch.arange(4) * 10, None), "hidden": [torch.ones(4, 2)]}
    first, second = split(outputs, [3, 1])
    assert first["logits"].tolist() == [0, 1, 2]
    assert second["pair"][0].tolist() == [30]
    assert second["pair"][1] is None
    assert second["hidden"][0].shape == (1, 2)


def test_split_refuses_outputs_without_enough_rows():
    with pytest.raises(ValueError, match=r"output leaf 1 has shape \(2,\); splitting needs dim 0 >= 3"):
        split((torch.ones(3), torch.ones(2)), [1, 2])


def test_collate_then_split_round_trip():
    requests = [[torch.rand(n, 4)] for n in (1, 3, 2)]
    batched, sizes = collate(requests, pad_to=8)
    parts = split(batched[0] * 2, sizes)
    for req, part in zip(requests, parts):
        torch.testing.assert_close(part, req[0] * 2)
