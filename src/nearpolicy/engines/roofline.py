"""The roofline of a rollout's decode steps: the least time the machine could take for them, from two measured rates
(`nearpolicy doctor`: the GEMM peak, FLOP/s, and the STREAM-like memory bandwidth, bytes/s). Pure arithmetic, no model.

One decode step runs `sequences` live sequences one token each, attending over `context_tokens` KV positions in all
(the sum of the live sequences' cached lengths). Its cost is bounded below by compute and by memory traffic:

    flops = 2 N b + 4 L H c           (a multiply-add per weight per token; QK^T and AV over the cache: 2 x 2 L H c)
    bytes = W + kv_bytes_per_token c   (every weight read once per step, whatever b; every cached K and V read once)
    t     = max(flops / peak, bytes / bandwidth)

N parameters (the tied embedding once, as the LM head), L layers, H = heads x head dim (the query width), b = sequences,
c = context_tokens, W the weights' bytes at the engine's precision, kv_bytes_per_token = 2 (K, V) x L x kv heads x head
dim x bytes per cached value. A step's decode calls are summed, each at its own live batch (the batch shrinks as
sequences stop, which is why a small-batch call is bandwidth bound: W is paid per call, not per token). The prefill,
sampling and the logits copy are left out; bench/harness.py's decode bound is the compute term alone at c = 0."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeShape:
    """The model as the roofline sees it: `parameters` N, `layers` L, `query_width` H = heads x head dim,
    `weight_bytes` W (at the engine's precision, tied weights once), `kv_bytes_per_token` (all layers, K and V)."""

    parameters: int
    layers: int
    query_width: int
    weight_bytes: float
    kv_bytes_per_token: float


@dataclass(frozen=True)
class DecodeStep:
    """`count` decode calls alike: each with `sequences` live sequences reading `context_tokens` cached positions in
    all (a histogram row: bench/profiles.py buckets decode calls by live sequences)."""

    sequences: int
    context_tokens: int
    count: int = 1


def step_flops(shape: DecodeShape, step: DecodeStep) -> float:
    """FLOPs of one decode call of `step`: 2 N b + 4 L H c."""
    return 2.0 * shape.parameters * step.sequences + 4.0 * shape.layers * shape.query_width * step.context_tokens


def step_bytes(shape: DecodeShape, step: DecodeStep) -> float:
    """Bytes one decode call of `step` reads: W + kv_bytes_per_token x c."""
    return shape.weight_bytes + shape.kv_bytes_per_token * step.context_tokens


def roofline_seconds(shape: DecodeShape, steps: Iterable[DecodeStep], peak_flops: float,
                     bandwidth: float) -> dict[str, float]:
    """The roofline of a set of decode calls: {"seconds": sum over calls of max(flops / peak, bytes / bandwidth),
    "compute_s": the calls' summed compute term, "memory_s": their summed memory term, "memory_bound_calls": how many
    calls the memory term bounds}. peak_flops in FLOP/s, bandwidth in bytes/s, both > 0 (ValueError otherwise)."""
    if not (peak_flops > 0 and bandwidth > 0):
        raise ValueError(f"peak_flops and bandwidth must be > 0, got {peak_flops} and {bandwidth}")
    out = {"seconds": 0.0, "compute_s": 0.0, "memory_s": 0.0, "memory_bound_calls": 0.0}
    for step in steps:
        compute = step_flops(shape, step) / peak_flops
        memory = step_bytes(shape, step) / bandwidth
        out["seconds"] += step.count * max(compute, memory)
        out["compute_s"] += step.count * compute
        out["memory_s"] += step.count * memory
        out["memory_bound_calls"] += step.count * (memory > compute)
    return out


def synchronous_decode_steps(prompt_lengths: list[int], completion_lengths: list[int]) -> list[DecodeStep]:
    """The decode calls of one synchronous generate over these sequences (all prefilled together, none joining
    later): token 1 comes from the prefill; call j (j = 1 .. max length - 1) carries every sequence with at least
    j + 1 tokens, each attending over its prompt + j positions (engines/llama_context.py; rollout/decode_calls =
    response/length_max - 1). Raises ValueError for lists of different lengths."""
    if len(prompt_lengths) != len(completion_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths and {len(completion_lengths)} completion lengths")
    steps = []
    for j in range(1, max(completion_lengths, default=0)):
        live = [p for p, n in zip(prompt_lengths, completion_lengths) if n >= j + 1]
        steps.append(DecodeStep(len(live), sum(live) + j * len(live)))
    return steps


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: float) -> float:
    """Cached bytes per token position: K and V, every layer (f16 cache: bytes_per_value 2)."""
    return 2.0 * layers * kv_heads * head_dim * bytes_per_value
