"""oneDNN-packed projections (raycolo/engine/executor/packed.py) on CPUs that can and cannot
pack each dtype."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_is_packed_only_where_this_cpu_can_and_multiplies_as_the_plain_one(dtype):
    """oneDNN packs bfloat16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (torch
    says which: ``_is_mkldnn_bf16_supported``); on an AVX2-only CPU packing it raised, and
    a bfloat16 model failed to load. Now such a linear stays plain; either way the product
    is ``F.linear``'s."""
    import torch.nn.functional as F

    from raycolo.engine.executor.packed import MIN_PACKED_WEIGHTS, PackedLinear, packed_or_plain

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, MIN_PACKED_WEIGHTS // 512, bias=False).to(dtype)
    out = packed_or_plain(linear)
    can = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert isinstance(out, PackedLinear) == (can and torch.backends.mkldnn.is_available())
    x = torch.randn(5, 512, dtype=dtype)
    with torch.inference_mode():
        torch.testing.assert_close(out(x), F.linear(x, linear.weight), rtol=1e-2, atol=1e-2)
