"""engines/roofline.py against hand-computed numbers (N = 100M parameters, 30 layers, query width 576, 144 MB of
weights, an f16 cache of 3 KV heads x 64; a peak of 200 GFLOP/s and 10 GB/s)."""

from __future__ import annotations

import pytest

from nearpolicy.engines.roofline import (DecodeShape, DecodeStep, kv_bytes_per_token, roofline_seconds,
                                         synchronous_decode_steps)

KV = kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, bytes_per_value=2)
SHAPE = DecodeShape(parameters=100_000_000, layers=30, query_width=576, weight_bytes=144e6, kv_bytes_per_token=KV)


def test_a_full_call_is_compute_bound_and_small_calls_are_memory_bound():
    assert KV == 23040  # 2 x 30 x 3 x 64 x 2 bytes
    full = DecodeStep(sequences=32, context_tokens=3200)  # flops 6.4e9 + 4 x 30 x 576 x 3200 = 6.621184e9
    small = DecodeStep(sequences=1, context_tokens=120, count=10)  # bytes 144e6 + 23040 x 120 = 146.7648e6
    r = roofline_seconds(SHAPE, [full, small], peak_flops=200e9, bandwidth=10e9)
    # full: max(0.03310592 compute, 0.0217728 memory); small: 10 x max(0.001041472, 0.01467648)
    assert r["seconds"] == pytest.approx(0.03310592 + 0.1467648, rel=1e-12)
    assert r["compute_s"] == pytest.approx(0.03310592 + 0.01041472, rel=1e-12)
    assert r["memory_s"] == pytest.approx(0.0217728 + 0.1467648, rel=1e-12)
    assert r["memory_bound_calls"] == 10
    assert roofline_seconds(SHAPE, [], 1.0, 1.0)["seconds"] == 0.0
    with pytest.raises(ValueError):
        roofline_seconds(SHAPE, [full], peak_flops=0.0, bandwidth=10e9)


def test_synchronous_decode_steps_follow_the_shrinking_batch():
    # token 1 from the prefill; call 1 carries both (contexts 10 + 1 and 20 + 1), call 2 the 3-token one (10 + 2)
    assert synchronous_decode_steps([10, 20], [3, 2]) == [DecodeStep(2, 32), DecodeStep(1, 12)]
    assert synchronous_decode_steps([10, 20], [1, 1]) == []  # both ended at the prefill's token
    assert len(synchronous_decode_steps([54] * 32, [64] * 32)) == 63  # rollout/decode_calls = length_max - 1
    with pytest.raises(ValueError):
        synchronous_decode_steps([10], [3, 2])
