"""The trainer's own ceiling on this CPU (issue 39 item 4): how fast can SmolLM2-135M's forward + backward go per
token, whatever the update does around it?

The probe: one row of M random token ids through the model body (plain causal attention, no cache, no padding), the
LM head at every position, log-softmax, one picked log-prob per position summed and back-propagated: the arithmetic
of an update micro-batch with nothing of nearpolicy's around it (no shared prompt, no packing mask, no loss terms).
Rates count FLOPs as 6 N M (N = the model's parameters, the tied head included; attention's M^2 terms left out, under
2 % here). For one M, torch's profiler splits the time into matrix products (aten::mm, addmm, bmm) and the rest
(normalisation, activations, rotary, softmax, adds), and the products' own rate is their FLOPs over their time.
`--compiled` also runs the body under torch.compile (inductor, dynamic shapes) and reports its compile time.
Best of --repeats after a warm-up, each M; run on a quiet machine.

    .venv/bin/python bench/update_ceiling.py [--threads 2] [--repeats 3] [--compiled] [--out docs/bench/update-ceiling.md]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from nearpolicy.doctor import cpu_model

LENGTHS = (54, 107, 161, 320, 650, 1300)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def step_function(model, body, rows: int):
    """A closure running one forward + backward of `rows` random ids through `body` and the tied head."""
    ids = torch.randint(0, model.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
    head = model.get_output_embeddings().weight

    def step() -> None:
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state[0]  # [M, H]
        logprobs = torch.log_softmax(hidden @ head.T, dim=-1)  # [M, V]
        logprobs[:, 0].sum().backward()
        model.zero_grad(set_to_none=True)

    return step


def best_seconds(step, repeats: int) -> float:
    step()  # warm-up (and, compiled, the compile for this shape)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_share(step) -> float:
    """Share of one step's CPU time spent in matrix products, by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="also time the body under torch.compile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from nearpolicy.engines.roofline import measure_rates
    from nearpolicy.model.load import default_model_gguf, load_policy
    from nearpolicy.training.allocator import reuse_freed_memory

    torch.set_num_threads(args.threads)
    reuse_freed_memory(True)  # as in a run (run.reuse_freed_memory defaults to on)
    peak = measure_rates().peak_flops / 1e9
    model, _ = load_policy(str(default_model_gguf()))
    n = sum(p.numel() for p in model.parameters())
    arms = {"eager": model.base_model}
    compile_s = None
    if args.compiled:
        arms["torch.compile"] = torch.compile(model.base_model, dynamic=True)
        start = time.perf_counter()
        step_function(model, arms["torch.compile"], 200)()
        compile_s = time.perf_counter() - start
    rows = []
    for m in LENGTHS:
        rates = [6.0 * n * m / best_seconds(step_function(model, body, m), args.repeats) / 1e9 for body in arms.values()]
        rows.append((m, rates))
        print(m, [f"{r:.0f}" for r in rates], flush=True)
    probe_m = 320
    share = matmul_share(step_function(model, model.base_model, probe_m))
    overall = dict(rows)[probe_m][0]
    lines = [
        "# The trainer's forward + backward ceiling on this CPU",
        "",
        f"Written by `bench/update_ceiling.py --threads {args.threads} --repeats {args.repeats}"
        f"{' --compiled' if args.compiled else ''}` on {cpu_model()} ({platform.machine()}), "
        f"{time.strftime('%Y-%m-%d')}; torch {torch.__version__}. SmolLM2-135M-Instruct fp32, N = {n / 1e6:.1f} M "
        f"parameters; the fp32 GEMM peak measured in this process (best 512^3 product of one thread times the "
        f"threads, as the roofline's): {peak:.0f} GFLOP/s.",
        "",
        "One row of M tokens, plain causal, forward + backward, LM head and log-softmax at every position; GFLOP/s "
        "count 6 N M; best of the repeats.",
        "",
        "| M tokens | " + " | ".join(f"{arm} GFLOP/s" for arm in arms) + " | eager ms / token | eager, of the GEMM peak |",
        "|---|" + "---|" * len(arms) + "---|---|",
    ]
    for m, rates in rows:
        lines.append(f"| {m} | " + " | ".join(f"{r:.0f}" for r in rates)
                     + f" | {6.0 * n / rates[0] / 1e6:.2f} | {100 * rates[0] / peak:.0f} % |")
    lines += [
        "",
        f"- At M = {probe_m}: matrix products take {100 * share:.0f} % of the step's CPU time (torch profiler), at "
        f"{overall / share:.0f} GFLOP/s ({100 * overall / share / peak:.0f} % of the peak); the other "
        f"{100 * (1 - share):.0f} % is element-wise work (RMSNorm, SiLU, rotary, residual adds, softmax).",
    ]
    if compile_s is not None:
        lines.append(f"- torch.compile (inductor, dynamic shapes): the first call took {compile_s:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
