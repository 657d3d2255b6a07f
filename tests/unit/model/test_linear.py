"""Linear's fast paths return what the plain dense product returns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.model.linear import Linear


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_weight_equals_dense_bitwise(rows: int) -> None:
    torch.manual_seed(0)
    layer = Linear(576, 960)
    weight = torch.randn(960, 576).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    if not layer.prepack(batch_hint=128):
        pytest.skip("this torch build has no oneDNN linear packing")
    assert layer.weight.is_mkldnn
    assert layer.weight.numel() * layer.weight.element_size() == weight.numel() * 2
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight))
    assert not layer.prepack(batch_hint=128)  # already packed
