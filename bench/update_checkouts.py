"""One whole policy update of the main job under two checkouts of nearpolicy, interleaved: what a change to the
trainer's path buys, measured where a run pays for it (every micro-batch's forward + backward, clipping, the
optimizer step at lr 0), paired in time so the machine's drift hits both alike.

The update: bench/shared_prompt.py's (the main job's settings: ppo_clip, tis, micro-batches of 8, the shared-prompt
path), 4 chain_sum prompts x G = 8 completions of random ids with lengths uniform in [--min-length, --max-length].
Each round runs every checkout in its own process (PYTHONPATH=CHECKOUT/src; the child checks that it imported that
checkout), the order reversed every other round: one warm-up update, then --updates timed; the figure per process
is their mean. Prints a markdown table and the paired ratio (median over rounds).

    .venv/bin/python bench/update_checkouts.py --checkout before=/path/to/old --checkout after=. [--rounds 3]
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

HERE = Path(__file__).resolve().parent


def one_process(args: argparse.Namespace) -> None:
    """Time the update in this process (the checkout on sys.path) and print {"seconds": mean} as the last line."""
    import torch

    from nearpolicy.batching import collate
    from nearpolicy.config.schema import load_config
    from nearpolicy.model.load import load_policy, pad_token_id
    from nearpolicy.training.trainer import update_settings
    from nearpolicy.types import SamplingParams
    from shared_prompt import make_rollouts, timed_update

    torch.set_num_threads(args.threads)
    cfg = load_config(None)
    settings, sampling = update_settings(cfg), SamplingParams(1.0, 1.0, 0, cfg.sampling.max_new_tokens)
    model, tokenizer = load_policy("smollm2")
    vocab = model.get_output_embeddings().weight.shape[0]
    rollouts = make_rollouts(tokenizer, vocab, 4, 8, (args.min_length, args.max_length), seed=args.seed)
    batch = collate(rollouts, pad_token_id(tokenizer), vocab, True)
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(1))
    timed_update(model, batch, settings, sampling, advantages)  # warm-up
    seconds = [timed_update(model, batch, settings, sampling, advantages)[0] for _ in range(args.updates)]
    tokens = sum(len(r.completion_ids) for r in rollouts)
    import nearpolicy

    print(json.dumps({"seconds": statistics.fmean(seconds), "completion_tokens": tokens,
                      "imported": str(Path(nearpolicy.__file__).resolve().parent.parent.parent)}))


def parse_checkouts(specs: list[str]) -> dict[str, Path]:
    """{NAME: resolved PATH} of the --checkout NAME=PATH arguments; exits naming the problem when one is malformed,
    a NAME repeats, a PATH holds no src/nearpolicy or fewer than two are given."""
    checkouts: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--checkout {spec!r}: expected NAME=PATH")
        if name in checkouts:
            raise SystemExit(f"--checkout {spec!r}: the name {name!r} is given twice")
        if not (Path(path) / "src" / "nearpolicy" / "__init__.py").is_file():
            raise SystemExit(f"--checkout {spec!r}: {path} holds no src/nearpolicy (a nearpolicy checkout's root)")
        checkouts[name] = Path(path).resolve()
    if len(checkouts) < 2:
        raise SystemExit("give two or more --checkout NAME=PATH")
    return checkouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to time (twice or more); PATH/src goes first on PYTHONPATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=2, help="timed updates per process, after one warm-up")
    parser.add_argument("--min-length", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        one_process(args)
        return
    checkouts = parse_checkouts(args.checkout)
    if args.rounds < 1 or args.updates < 1:
        raise SystemExit("--rounds and --updates must be at least 1")
    seconds: dict[str, list[float]] = {name: [] for name in checkouts}
    child = [sys.executable, __file__, "--one", "--updates", str(args.updates), "--min-length", str(args.min_length),
             "--max-length", str(args.max_length), "--seed", str(args.seed), "--threads", str(args.threads)]
    tokens = 0
    for round_ in range(args.rounds):
        order = list(checkouts.items())
        for name, path in order if round_ % 2 == 0 else order[::-1]:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path / "src"), str(HERE)]))
            done = subprocess.run(child, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"checkout {name} ({path}) failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if Path(result["imported"]) != path:
                raise SystemExit(f"checkout {name}: the child imported nearpolicy from {result['imported']}, not {path}")
            seconds[name].append(result["seconds"])
            tokens = result["completion_tokens"]
            print(f"round {round_} {name}: {result['seconds']:.2f} s", flush=True)
    first = next(iter(checkouts))
    print(f"\n{time.strftime('%Y-%m-%d')}, {args.threads} threads, 4 prompts x G = 8, {tokens} completion tokens "
          f"(lengths {args.min_length}-{args.max_length}), {args.rounds} rounds x {args.updates} updates\n")
    print("| checkout | update s per round | median | paired ratio to " + first + " (median over rounds) |")
    print("|---|---|---|---|")
    for name, values in seconds.items():
        ratio = statistics.median(v / b for v, b in zip(values, seconds[first]))
        print(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
