"""llama.cpp rollout tokens/s with 1 or 2 threads and with adaptive threads (engines/cpu_load.py), on an idle
machine and while one competing process keeps one core busy (a pure-Python loop, stopped when the bench ends).

The shipped SmolLM2 Q4_1 GGUF, a 54-token prompt (the length of a chat-templated chain_sum prompt), G = 8
samples x --prompts prompts, up to --new-tokens tokens at temperature 1; tokens/s = sampled tokens / wall time.

    .venv/bin/python bench/engine_threads.py [--prompts 4] [--new-tokens 32] [--repeats 3] [--out docs/bench/engine_threads.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

from nearpolicy.doctor import cpu_model
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.model.load import default_model_gguf
from nearpolicy.types import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import measure  # noqa: E402  (one warm-up, then the timed generate calls)

SETTINGS = {"2 threads": (2, False), "1 thread": (1, False), "adaptive (2)": (2, True)}


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/engine_threads.json"))
    args = parser.parse_args()
    prompt = tuple(range(1000, 1054))
    requests = [GenerationRequest(i, prompt, 8) for i in range(args.prompts)]
    sampling = SamplingParams(1.0, 1.0, 0, args.new_tokens)
    rows = []
    for load in ("idle", "1 core busy"):
        spinner = None
        if load != "idle":
            spinner = mp.get_context("spawn").Process(target=_spin, args=(1800.0,), daemon=True)
            spinner.start()
        try:
            for name, (threads, adaptive) in SETTINGS.items():
                request = EngineRequest("llamacpp", "q4_1", max_context=128, max_parallel_sequences=8 * args.prompts,
                                        threads=threads, adaptive_threads=adaptive, isolated=False)
                engine = build_engine(request, EngineInputs(gguf=default_model_gguf()))  # the shipped Q4_1 GGUF
                try:
                    tps = measure(engine, requests, sampling, args.repeats)["tokens_per_s_median"]
                    used = engine.threads_used  # the last timed call's
                finally:
                    engine.close()
                rows.append({"load": load, "setting": name, "tokens_per_s": tps, "threads_used": used})
                print(f"| {load} | {name} | {tps:.1f} | {used} |", flush=True)
        finally:
            if spinner is not None:
                spinner.kill()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
