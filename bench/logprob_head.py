"""The vocabulary-wide part of an update: log-prob of the sampled token and entropy from the LM head's logits
[n, V], forward + backward, fused (ops/fused_logprobs.py, what the trainer runs without top-k / top-p) against the
unfused log_softmax -> gather graph it replaced, repeats interleaved. The LM head's matmul is not timed (it is the
same in both). Writes docs/bench/logprob_head.json:

    .venv/bin/python bench/logprob_head.py --tokens 400 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from nearpolicy.doctor import cpu_model
from nearpolicy.ops.fused_logprobs import fused_logprobs_and_entropy


def unfused(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """The graph before the fused node (ops/logprobs.py without a kept set)."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        probs = logp.exp()
        entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).sum(-1)
    return picked, entropy


def fused(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    return fused_logprobs_and_entropy(logits, ids, temperature)


def one_pass(fn, logits: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> float:
    z = logits.detach().requires_grad_(True)
    start = time.perf_counter()
    picked, entropy = fn(z, ids, 1.0)
    (weight * picked).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400, help="completion tokens in one micro-batch's logits")
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/logprob_head.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(args.tokens, args.vocab, generator=g)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    weight = torch.randn(args.tokens, generator=g)
    routes = {"unfused": unfused, "fused": fused}
    for fn in routes.values():  # warm-up
        one_pass(fn, logits, ids, weight)
    times: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(args.repeats):
        for name, fn in routes.items():
            times[name].append(one_pass(fn, logits, ids, weight))
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "cpu": cpu_model(), "threads": args.threads, "tokens": args.tokens,
        "vocab": args.vocab, "repeats": args.repeats, "seconds": times, "median_s": medians,
        "fused_over_unfused": medians["fused"] / medians["unfused"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"[{args.tokens}, {args.vocab}] forward + backward: unfused {medians['unfused'] * 1e3:.1f} ms, "
          f"fused {medians['fused'] * 1e3:.1f} ms ({result['fused_over_unfused']:.2f}x)")


if __name__ == "__main__":
    main()
