"""kiln/parallel/zero1_shards.py `boxes`: a run of flat elements as the boxes it covers, in order
(the 3-rank save and load through DCP are in test_zero1_state.py)."""

import itertools
import math

import pytest
import torch

from kiln.parallel.zero1_shards import boxes


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 2)])
def test_every_run_is_its_elements_in_order_in_few_boxes(shape):
    flat = torch.arange(math.prod(shape)).view(shape)
    n = flat.numel()
    for start, end in itertools.combinations(range(n + 1), 2):
        got = boxes(shape, start, end)
        elements = [flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1) for offsets, sizes in got]
        assert torch.equal(torch.cat(elements), torch.arange(start, end)), (shape, start, end, got)
        assert all(all(s > 0 for s in sizes) for _, sizes in got)
        assert len(got) <= 2 * len(shape) - 1, (shape, start, end, got)
    assert boxes(shape, 3, 3) == []
    assert boxes(shape, 0, n) == [((0,) * len(shape), shape)]  # a whole tensor: one box
