"""Update erasure: how much of training's weight change a quantized engine receives (docs/results.md sec. 11).

For each run folder and each of its checkpoints, the engine weights the exporter writes (engines/gguf/export.py, the
run's engine.precision / tensor_precision, under nearest and under stochastic rounding with the run's seed) are
compared with those of the step-0 weights, over every tensor stored at a block type:
- erased: among the weights training moved, the fraction whose engine value is still the step-0 one;
- reach: |engine delta| / |master delta| (L2 over all those weights; 1 = the whole update reaches the engine);
- cosine between the engine delta and the master delta (does what reaches it point the right way).

    .venv/bin/python bench/erasure.py runs/grpo-smollm2-q4_1-plain runs/grpo-smollm2-q4_1-aligned-sr \\
        --out docs/bench/erasure.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from nearpolicy.model.aligned import engine_weight, module_precisions
from nearpolicy.engines.gguf.rounding import STOCHASTIC_TYPES
from nearpolicy.runs.start_checks import stored_config
from nearpolicy.model.load import load_policy

BLOCK_TYPES = ("q8_0", "q4_1", "q4_0", "q5_0", "mxfp4")


def _engine(weights: dict[str, torch.Tensor], types: dict[str, str], rounding: str, seed: int) -> dict[str, np.ndarray]:
    return {name: engine_weight(weights[name], types[name], rounding, seed)[0].numpy() for name in types}


def measure(run_dir: Path, roundings: tuple[str, ...] = ("nearest", "stochastic")) -> list[dict]:
    """One row per (checkpoint, rounding, weight type): erased, reach, cosine, weights counted."""
    cfg = stored_config(run_dir)
    model = load_policy(cfg.model.path)[0].float()
    precisions = module_precisions(model, cfg.engine.precision, tuple(cfg.engine.tensor_precision.items()))
    types = {f"{m}.weight": p for m, p in precisions.items() if p in BLOCK_TYPES}
    types = {n: p for n, p in types.items() if n in dict(model.named_parameters())}  # a tied head is the embedding
    start = {n: p.detach().clone() for n, p in model.named_parameters() if n in types}
    rows = []
    for rounding in roundings:
        if rounding == "stochastic" and not set(types.values()) <= set(STOCHASTIC_TYPES):
            print(f"{run_dir.name}: no stochastic rounding of {sorted(set(types.values()) - set(STOCHASTIC_TYPES))} "
                  "(engines/gguf/rounding.py covers q8_0 and q4_1)", flush=True)
            continue
        before = _engine(start, types, rounding, cfg.run.seed)
        for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
            trained = load_file(str(ckpt / "model.safetensors"))
            after = _engine(trained, types, rounding, cfg.run.seed)
            for kind in sorted(set(types.values())):
                names = [n for n in types if types[n] == kind]
                master = np.concatenate([(trained[n].numpy() - start[n].numpy()).ravel() for n in names])
                engine = np.concatenate([(after[n] - before[n]).ravel() for n in names])
                moved = master != 0
                rows.append({"run": run_dir.name, "step": int(ckpt.name.split("_")[1]), "rounding": rounding,
                             "rounding_used_by_run": rounding == cfg.engine.export_rounding, "type": kind,
                             "weights": int(master.size), "moved": float(moved.mean()),
                             "erased": float((engine[moved] == 0).mean()),
                             "reach": float(np.linalg.norm(engine) / max(np.linalg.norm(master), 1e-30)),
                             "cosine": float(engine @ master / max(np.linalg.norm(engine) * np.linalg.norm(master),
                                                                   1e-30))})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for run in args.runs for row in measure(run)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
