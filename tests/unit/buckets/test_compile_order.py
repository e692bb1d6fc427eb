"""The order a grid of compiled models compiles in: what answers everything first, then the most padding saved."""

import pytest

from neuron_serve.buckets.order import compile_order, expected_padding

MLP = ([[1]], [1, 4, 16, 32, 64], 64)  # deployments/mlp.yaml: one shape, five batch sizes
ENCODER = ([[32], [64], [128]], [1, 4, 16], 16)  # deployments/encoder.yaml: three sequence buckets


@pytest.mark.parametrize("grid", [MLP, ENCODER])
def test_every_model_of_the_grid_once_the_ready_one_first(grid):
    shapes, sizes, rows = grid
    ready = (len(shapes) - 1, max(sizes))
    order = compile_order(shapes, sizes, rows, [ready])
    assert order[0] == ready
    assert sorted(order) == sorted((b, s) for b in range(len(shapes)) for s in sizes)


@pytest.mark.parametrize("grid", [MLP, ENCODER])
def test_each_next_model_saves_at_least_as_much_as_any_other_would(grid):
    shapes, sizes, rows = grid
    order = compile_order(shapes, sizes, rows, [(len(shapes) - 1, max(sizes))])
    for k in range(1, len(order)):
        done = set(order[:k])
        chosen = expected_padding(done | {order[k]}, shapes, rows)
        assert all(chosen <= expected_padding(done | {e}, shapes, rows) for e in order[k:])


def test_the_examples_orders():
    """The orders the serving guide gives (model.yaml's examples)."""
    assert compile_order(*MLP, [(0, 64)]) == [(0, 64), (0, 16), (0, 4), (0, 32), (0, 1)]
    assert compile_order(*ENCODER, [(2, 16)]) == [(2, 16), (1, 4), (0, 4), (2, 4), (1, 16), (0, 16), (2, 1),
                                                   (1, 1), (0, 1)]


def test_padding_falls_from_the_first_model_to_the_whole_grid():
    shapes, sizes, rows = ENCODER
    first = expected_padding({(2, 16)}, shapes, rows)
    every = expected_padding({(b, s) for b in range(3) for s in sizes}, shapes, rows)
    assert 0 < every < first < 1
    assert expected_padding({(0, 16)}, shapes, rows) == 1.0  # a shape no compiled bucket holds


def test_recorded_traffic_puts_the_buckets_it_uses_first():
    """Inputs recorded all at the shortest length: its bucket compiles right after the ready one, at each batch size,
    and a bucket no input needs comes last; each step still the most saved for that traffic."""
    shapes, sizes, rows = ENCODER
    weights = (1.0, 0.0, 0.0)
    order = compile_order(shapes, sizes, rows, [(2, 16)], weights)
    assert order[1:4] == [(0, 4), (0, 16), (0, 1)]
    assert {e[0] for e in order[4:]} == {1, 2}
    for k in range(1, len(order)):
        done = set(order[:k])
        chosen = expected_padding(done | {order[k]}, shapes, rows, weights)
        assert all(chosen <= expected_padding(done | {e}, shapes, rows, weights) for e in order[k:])
    assert compile_order(shapes, sizes, rows, [(2, 16)], (1 / 3,) * 3) == compile_order(shapes, sizes, rows, [(2, 16)])
