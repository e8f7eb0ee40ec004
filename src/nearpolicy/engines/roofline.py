"""The roofline of a rollout's decode steps: the least time the machine could take for them, from two measured rates
(the GEMM peak, FLOP/s, and the STREAM-like memory bandwidth, bytes/s), measured by the probes at the end of this
module, which `nearpolicy doctor` and a run's start share. Arithmetic on plain numbers, no model.

One decode step runs `sequences` live sequences one token each, attending over `context_tokens` KV positions in all
(the sum of the live sequences' cached lengths). Its cost is bounded below by compute and by memory traffic:

    flops = 2 N b + 4 L H c           (a multiply-add per weight per token; QK^T and AV over the cache: 2 x 2 L H c)
    bytes = W + kv_bytes_per_token c   (every weight read once per step, whatever b; every cached K and V read once)
    t     = max(flops / peak, bytes / bandwidth)

N parameters (the tied embedding once, as the LM head), L layers, H = heads x head dim (the query width), b = sequences,
c = context_tokens, W the weights' bytes at the engine's precision, kv_bytes_per_token = 2 (K, V) x L x kv heads x head
dim x bytes per cached value. A step's decode calls are summed, each at its own live batch (the batch shrinks as
sequences stop, which is why a small-batch call is bandwidth bound: W is paid per call, not per token). The prefill,
sampling and the logits copy are left out; bench/harness.py's decode bound is the compute term alone at c = 0.

Per training step the rollout reports `rollout/roofline_s` (this bound over the step's counted decode calls) and
`rollout/roofline_share` = roofline_s / the measured rollout seconds (`roofline_metrics`; rollouts/inline.py). A
share near 1 means the engine decodes as fast as the machine's two rates allow; the prefill's time is in the
denominator only, so a share of 1 is out of reach by that much."""

from __future__ import annotations

import time
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


@dataclass(frozen=True)
class MachineRates:
    """The roofline's two rates for `threads` threads, measured on this machine (`measure_rates`): `peak_flops`
    (FLOP/s: torch's fp32 GEMM, `gemm_gflops`) and `bandwidth` (bytes/s: the faster of STREAM's copy and triad,
    `memory_bandwidth`; the faster gives the lower bound)."""

    peak_flops: float
    bandwidth: float
    threads: int

    @classmethod
    def of(cls, gflops: float, stream_gbs: dict[str, float], threads: int) -> "MachineRates":
        """From the probes' units: GEMM GFLOP/s and {"copy": GB/s, "triad": GB/s}."""
        return cls(gflops * 1e9, max(stream_gbs.values()) * 1e9, threads)

    def metrics(self) -> dict[str, float]:
        """rollout/roofline_peak_gflops and rollout/roofline_bandwidth_gbs (1e9 bytes/s): recorded beside the bound."""
        return {"rollout/roofline_peak_gflops": self.peak_flops / 1e9,
                "rollout/roofline_bandwidth_gbs": self.bandwidth / 1e9}

    def describe(self) -> str:
        threads = f"{self.threads} thread" + "s" * (self.threads != 1)
        return (f"GEMM peak {self.peak_flops / 1e9:.1f} GFLOP/s (fp32, {threads}), memory bandwidth "
                f"{self.bandwidth / 1e9:.1f} GB/s")


def roofline_metrics(shape: DecodeShape, steps: Iterable[DecodeStep], rates: MachineRates,
                     rollout_seconds: float | None) -> dict[str, float]:
    """One step's roofline metrics: rollout/roofline_s (`roofline_seconds` of the step's decode calls, seconds),
    rollout/roofline_share = roofline_s / rollout_seconds (the measured rollout wall time, > 0, ValueError otherwise;
    no share when None), rollout/roofline_compute_s and roofline_memory_s (the two terms summed over the calls),
    rollout/roofline_memory_bound_calls, and the rates (MachineRates.metrics): with every call on one side of the
    ridge, the bound at other rates is that side's sum rescaled."""
    if rollout_seconds is not None and not rollout_seconds > 0:
        raise ValueError(f"rollout_seconds must be > 0, got {rollout_seconds}")
    bound = roofline_seconds(shape, steps, rates.peak_flops, rates.bandwidth)
    out = {"rollout/roofline_s": bound["seconds"], "rollout/roofline_compute_s": bound["compute_s"],
           "rollout/roofline_memory_s": bound["memory_s"],
           "rollout/roofline_memory_bound_calls": bound["memory_bound_calls"], **rates.metrics()}
    if rollout_seconds is not None:
        out["rollout/roofline_share"] = bound["seconds"] / rollout_seconds
    return out


# -- the probes of the two rates (torch, imported lazily) ------------------------------------------------------------
def gemm_gflops(dtype, n: int = 512, seconds: float = 0.5, best: bool = False) -> float:
    """n x n x n matmul throughput of torch in `dtype` on its threads (GFLOP/s, 2 n^3 flops a product) over `seconds`
    of products: sustained (products / elapsed), or with `best` the fastest product's (the peak: on a shared machine a
    product that no other process slowed; what a lower bound needs)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    fastest, count, t0 = float("inf"), 0, time.perf_counter()
    while (t1 := time.perf_counter()) - t0 < seconds:
        a @ b
        fastest, count = min(fastest, time.perf_counter() - t1), count + 1
    return 2 * n**3 * (1 / fastest if best else count / (time.perf_counter() - t0)) / 1e9


def memory_bandwidth(mib: int = 128, repeats: int = 5) -> dict[str, float]:
    """STREAM-like memory bandwidth of torch on its threads, GB/s (1e9 bytes/s), best of `repeats`, over float32
    arrays of `mib` MiB each, far larger than a last-level cache: {"copy": c = a, counted as 2 arrays moved; "triad":
    a = b + s c, 3 arrays} (McCalpin's STREAM counting; write-allocate traffic not counted)."""
    import torch

    n = mib * 2**20 // 4
    a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.zeros(n)  # written once: the pages are mapped before timing
    best = {"copy": float("inf"), "triad": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        c.copy_(a)
        t1 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        t2 = time.perf_counter()
        best = {"copy": min(best["copy"], t1 - t0), "triad": min(best["triad"], t2 - t1)}
    return {"copy": 2 * n * 4 / best["copy"] / 1e9, "triad": 3 * n * 4 / best["triad"] / 1e9}


def measure_rates() -> MachineRates:
    """Both rates for torch's current thread count t, each the best it reached (about 1 s): the GEMM peak is t x the
    fastest fp32 product on one thread in 0.5 s (a product on t threads of a shared machine waits for its slowest
    core: measured so on 2 busy cores it read 17 GFLOP/s against 105 on one; per-core peak x cores can only overstate
    the rate, so the bound stays a lower bound), the bandwidth the faster STREAM kernel on t threads, best of 5."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_core = gemm_gflops(torch.float32, best=True)
    finally:
        torch.set_num_threads(threads)
    return MachineRates.of(per_core * threads, memory_bandwidth(), threads)
