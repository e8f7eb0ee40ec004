"""Weight-sync cost on the llama.cpp engine: SmolLM2-135M-Instruct (fp32 trainer weights) synced into an engine
process, the way the main job does it, by the two routes side by side in one run, repeats interleaved:

- whole: the GGUF written whole (engines/gguf/export.export_model_gguf: metadata, tensors, fsync, atomic rename) and
  the engine reloading it (the route of every sync before engines/gguf/inplace.py);
- in place: engines/gguf/inplace.EngineGGUF rewriting the tensors of the file the engine maps, the engine dropping
  its KV caches.

Each sync follows a small perturbation of every weight (as an optimizer step would), and ends when the engine has
scored a short completion (so a lazy reload is paid inside the sync). Writes docs/bench/weight_sync.json:

    .venv/bin/python bench/weight_sync.py --precision q8_0 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from nearpolicy.engines.gguf.export import export_model_gguf
from nearpolicy.engines.gguf.inplace import EngineGGUF
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.model.load import default_model_gguf, load_policy
from nearpolicy.types import SamplingParams

PROMPT, COMPLETION = [1, 504, 3287, 28, 1085, 6001], [400, 500, 600, 700, 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="q8_0")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/weight_sync.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("smollm2")
    template = default_model_gguf()
    sampling = SamplingParams(1.0, 1.0, 0, 8)
    folder = Path(tempfile.mkdtemp())
    whole_dir, in_place = folder / "whole", EngineGGUF(model, folder / "in-place", args.precision, (), template,
                                                       tokenizer, log=print)
    engines = {}
    for route, path in (("whole", export_model_gguf(model, whole_dir, args.precision, (), template, tokenizer)),
                        ("in place", in_place())):
        request = EngineRequest("llamacpp", args.precision, max_context=1024, max_parallel_sequences=64,
                                threads=args.threads, kv_cache="f16", flash_attention=False, isolated=True)
        logs = folder / "logs" / route  # a folder a route: each engine process logs to its llamacpp.log
        logs.mkdir(parents=True, exist_ok=True)
        engines[route] = build_engine(request, EngineInputs(gguf=path, workdir=logs))
    sync = {"whole": lambda: export_model_gguf(model, whole_dir, args.precision, (), template, tokenizer),
            "in place": in_place}
    times: dict[str, list[float]] = {route: [] for route in sync}
    scores = {}
    try:
        for version in range(1, args.repeats + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4 * torch.randn_like(p))
            for route, write in sync.items():
                started = time.perf_counter()
                engines[route].update_weights(write(), version)
                scores[route] = engines[route].score(PROMPT, COMPLETION, sampling)
                times[route].append(time.perf_counter() - started)
            if scores["whole"] != scores["in place"]:
                raise SystemExit(f"the routes disagree at version {version}: {scores}")
    finally:
        for engine in engines.values():
            engine.close()
    median = {route: sorted(t)[len(t) // 2] for route, t in times.items()}
    result = {"precision": args.precision, "threads": args.threads, "repeats": args.repeats,
              "cpu": platform.processor() or platform.machine(), "seconds": times, "median_s": median,
              "command": f".venv/bin/python bench/weight_sync.py --precision {args.precision} --repeats {args.repeats}"}
    try:
        result["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for route, t in times.items():
        print(f"{route}: median {median[route]:.3f} s per sync ({', '.join(f'{x:.3f}' for x in t)})")


if __name__ == "__main__":
    main()
