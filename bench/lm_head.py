"""The LM head at 262k vocabulary: peak memory and time of one micro-batch of the policy's log-prob path
(model/policy.sequence_logprobs -> a loss -> backward, what the update runs per micro-batch; and forward only under
no_grad, what old_logprobs and the reference model run), SmolLM2-135M (V = 49152) and Gemma 3 270M (V = 262144),
the LM head unchunked (the [n, V] logits, their gradient and the fused node's temporaries) against the chunked head
(ops/chunked_head.py). One GRPO group: a 20-token prompt, 8 completions of 130 tokens (n = 1040 logit rows),
the shared-prompt path, float32, torch threads 2, run.reuse_freed_memory on (training/allocator.py), as a run has it.

Seconds are wall time per micro-batch; CPU s the process's CPU time over it (both threads; it leaves out time the
process waits for the cores, not the time its threads spin at a barrier, so contention inflates it too). Each
(model, arm, mode) runs in its own process, so peaks do not mix: load, one warm-up micro-batch (the parameters'
gradients exist from then on, as within an update), malloc_trim, reset the peak (/proc/self/clear_refs 5), then
`--steps` timed micro-batches; peak = VmHWM over the timed ones. Rounds alternate the arms' order (ABBA) so drift on
a shared machine hits both alike. `--before SRC` adds the arm "before": the code before the chunked head, a copy of
the package's src at that commit put first on PYTHONPATH. Prints a markdown table (docs/bench/lm-head.md):

    git archive HEAD src | tar -x -C /tmp/before    # the commit before the chunked head
    .venv/bin/python bench/lm_head.py --rounds 3 --before /tmp/before/src
    .venv/bin/python bench/lm_head.py --paired --steps 4 --threads 1   # timing: the heads alternated in one process
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ARMS = ("unchunked", "chunked")
MODES = ("train", "no_grad")
MODELS = {"smollm2": "llama", "gemma3-270m": "gemma3_text"}  # name -> config.json model_type


def model_folder(model_type: str) -> str:
    """The float32 HF folder under ~/.cache/nearpolicy/gguf-hf whose config has `model_type` (the largest of them:
    the tests' tiny llamas live there too). Raises SystemExit when there is none."""
    found = []
    for config in Path.home().glob(".cache/nearpolicy/gguf-hf/*/config.json"):
        data = json.loads(config.read_text())
        if data.get("model_type") == model_type:
            found.append((data.get("hidden_size", 0), str(config.parent)))
    if not found:
        raise SystemExit(f"no HF folder of model_type {model_type} under ~/.cache/nearpolicy/gguf-hf")
    return max(found)[1]


def _status(key: str) -> float:
    """/proc/self/status's `key` (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def group_batch(vocab: int, prompt: int, completion: int, group: int):
    """One GRPO group: a `prompt`-token prompt and `group` completions of `completion` tokens, random ids."""
    from nearpolicy.batching import collate
    from nearpolicy.types import Rollout

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (prompt,), generator=g).tolist()
    rollouts = [Rollout(0, k, ids, torch.randint(3, vocab, (completion,), generator=g).tolist(), [-1.0] * completion,
                        [0] * completion, "length") for k in range(group)]
    return collate(rollouts, 0, vocab, shared_prompt=True)


def _setup(model_name: str, args):
    """(policy module, model, batch, loss weights [B, T], sampling) in this process, torch threads and the heap as a
    run has them."""
    from transformers import AutoModelForCausalLM

    import nearpolicy.model.policy as policy
    from nearpolicy.training.allocator import reuse_freed_memory
    from nearpolicy.types import SamplingParams

    torch.set_num_threads(args.threads)
    reuse_freed_memory(True)
    model = AutoModelForCausalLM.from_pretrained(model_folder(MODELS[model_name]), dtype=torch.float32)
    batch = group_batch(model.get_output_embeddings().weight.shape[0], args.prompt, args.completion, args.group)
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(1))
    return policy, model, batch, weights, SamplingParams(temperature=args.temperature)


def _micro_batch(policy, model, batch, weights, sampling, mode: str) -> tuple[float, float]:
    """One micro-batch (train: forward + backward of a weighted log-prob sum; no_grad: forward only): (wall s, CPU
    s of this process)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    if mode == "no_grad":
        with torch.no_grad():
            policy.sequence_logprobs(model, batch, sampling)
    else:
        logprobs, _ = policy.sequence_logprobs(model, batch, sampling)
        (weights * logprobs).sum().backward()
    return time.perf_counter() - start, time.process_time() - start_cpu


def child(model_name: str, arm: str, mode: str, args) -> dict:
    """One configuration in this (fresh) process: its peak RSS over the timed micro-batches and their seconds."""
    from nearpolicy.training.allocator import release_freed_memory

    policy, model, batch, weights, sampling = _setup(model_name, args)
    default_budget = getattr(policy, "FULL_LOGITS_BUDGET", None)
    policy.FULL_LOGITS_BUDGET = 0 if arm == "chunked" else float("inf")  # "before": no such knob, no effect
    assert arm != "before" or not hasattr(policy, "uses_chunked_head"), "--before must be the code before it"
    _micro_batch(policy, model, batch, weights, sampling, mode)
    release_freed_memory()
    loaded = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    times = [_micro_batch(policy, model, batch, weights, sampling, mode) for _ in range(args.steps)]
    rows, vocab = int(batch.mask.sum()), model.get_output_embeddings().weight.shape[0]
    rule = None if default_budget is None else ("chunked" if rows * vocab * 4 > default_budget else "unchunked")
    return {"model": model_name, "arm": arm, "mode": mode, "vocab": vocab, "rows": rows, "rule": rule,
            "rss_loaded_mib": loaded, "peak_mib": _status("VmHWM"), "seconds": [t[0] for t in times],
            "cpu_seconds": [t[1] for t in times]}


def paired(model_name: str, args) -> list[dict]:
    """Timing only, one process per model: per mode, the two heads alternated micro-batch by micro-batch (ABBA),
    `--steps` pairs after a warm-up of each; peaks mix here, so no RSS."""
    policy, model, batch, weights, sampling = _setup(model_name, args)
    out = []
    for mode in args.modes.split(","):
        times: dict[str, list] = {"unchunked": [], "chunked": []}
        for i in range(args.steps + 1):
            for arm in ("unchunked", "chunked") if i % 2 == 0 else ("chunked", "unchunked"):
                policy.FULL_LOGITS_BUDGET = 0 if arm == "chunked" else float("inf")
                t = _micro_batch(policy, model, batch, weights, sampling, mode)
                if i:  # the first pair warms up
                    times[arm].append(t)
        out.append({"model": model_name, "mode": mode, "threads": args.threads, "times": times})
    return out


def _common(args) -> list[str]:
    return ["--threads", str(args.threads), "--steps", str(args.steps), "--prompt", str(args.prompt), "--completion",
            str(args.completion), "--group", str(args.group), "--temperature", str(args.temperature), "--modes",
            args.modes]


def run_child(model_name: str, arm: str, mode: str, args) -> dict:
    command = [sys.executable, __file__, "--child", model_name, arm, mode] + _common(args)
    env = dict(os.environ)
    if arm == "before":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.before, env.get("PYTHONPATH")) if p)
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    """Markdown: per (model, mode, arm) the median peak and loaded RSS, the step's growth, median and min seconds."""
    lines = ["| model | V | rows n | mode | head | RSS loaded MiB | peak MiB | peak - loaded MiB | s / micro-batch "
             "(median) | min s | CPU s (median) | runs |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rules = {r["model"]: r["rule"] for r in results if r["rule"]}
    keys = dict.fromkeys((r["model"], r["mode"], r["arm"]) for r in results)
    for model_name, mode, arm in keys:
        rs = [r for r in results if (r["model"], r["mode"], r["arm"]) == (model_name, mode, arm)]
        loaded = statistics.median(r["rss_loaded_mib"] for r in rs)
        peak = statistics.median(r["peak_mib"] for r in rs)
        growth = statistics.median(r["peak_mib"] - r["rss_loaded_mib"] for r in rs)
        seconds, cpu = [s for r in rs for s in r["seconds"]], [s for r in rs for s in r["cpu_seconds"]]
        head = f"**{arm}** (default)" if rules.get(model_name) == arm else arm
        lines.append(f"| {model_name} | {rs[0]['vocab']} | {rs[0]['rows']} | {mode} | {head} | {loaded:.0f} | "
                     f"{peak:.0f} | {growth:.0f} | {statistics.median(seconds):.2f} | {min(seconds):.2f} | "
                     f"{statistics.median(cpu):.2f} | "
                     f"{len(seconds)} |")
    return "\n".join(lines)


def paired_table(results: list[dict]) -> str:
    """Markdown: per (model, mode) each head's median wall and CPU seconds and the median over pairs of the CPU-time
    ratio chunked / unchunked (adjacent micro-batches: drift on a shared machine cancels in the ratio)."""
    lines = ["| model | mode | threads | pairs | unchunked s (median) | chunked s (median) | unchunked CPU s | "
             "chunked CPU s | chunked / unchunked, CPU (median of pairs) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, b = r["times"]["unchunked"], r["times"]["chunked"]
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        ratio = statistics.median(y[1] / x[1] for x, y in zip(a, b))
        lines.append(f"| {r['model']} | {r['mode']} | {r['threads']} | {len(a)} | {med(a, 0):.2f} | {med(b, 0):.2f} | "
                     f"{med(a, 1):.2f} | {med(b, 1):.2f} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "ARM", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3, help="processes per configuration, arms alternated")
    parser.add_argument("--steps", type=int, default=2, help="timed micro-batches per process")
    parser.add_argument("--prompt", type=int, default=20)
    parser.add_argument("--completion", type=int, default=130)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--before", help="src folder of the code before the chunked head: adds the arm 'before'")
    parser.add_argument("--paired", action="store_true", help="timing only: the two heads alternated in one process")
    parser.add_argument("--paired-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    if args.paired_child:
        print(json.dumps(paired(args.paired_child, args)))
        return
    from nearpolicy.doctor import cpu_model

    if args.paired:
        results = []
        for model_name in args.models.split(","):
            command = [sys.executable, __file__, "--paired-child", model_name] + _common(args)
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results += json.loads(out.strip().splitlines()[-1])
        print(f"CPU: {cpu_model()}, torch {torch.__version__}, {args.threads} threads; paired timing, one group: "
              f"prompt {args.prompt} + {args.group} x {args.completion} completion tokens\n")
        print(paired_table(results))
        return
    arms, results = args.arms.split(","), []
    arms = (["before"] if args.before else []) + arms
    for round_ in range(args.rounds):
        for model_name in args.models.split(","):
            for mode in args.modes.split(","):
                for arm in arms if round_ % 2 == 0 else arms[::-1]:
                    results.append(run_child(model_name, arm, mode, args))
                    r = results[-1]
                    print(f"round {round_} {model_name} {mode} {arm}: peak {r['peak_mib']:.0f} MiB (loaded "
                          f"{r['rss_loaded_mib']:.0f}), s {' '.join(f'{s:.2f}' for s in r['seconds'])}, CPU s "
                          f"{' '.join(f'{s:.2f}' for s in r['cpu_seconds'])}",
                          file=sys.stderr, flush=True)
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {args.threads} threads; one group: prompt {args.prompt} "
          f"+ {args.group} x {args.completion} completion tokens, temperature {args.temperature}\n")
    print(table(results))


if __name__ == "__main__":
    main()
