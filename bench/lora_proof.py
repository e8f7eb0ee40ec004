"""The LoRA sync proof's numbers on SmolLM2-135M-Instruct (docs/lora.md): per engine precision, the probe gap mean
|engine - trainer| (nats/token) with the trainer's frozen base read from the engine's own GGUF, at version 0 (lora_B =
0) and with random adapters of growing size, and the seconds of each adapter sync (GGUF write, update_weights
through the engine process, the proof).

    PYTHONPATH=src .venv/bin/python bench/lora_proof.py q8_0 q4_1 --out /tmp/lora-proof

The probe is the training one (training/lora_sync.py: the last PROBE_CONTEXT tokens of chain_sum's first PROBE_PROMPTS
prompts + PROBE_TEXT); per precision the proof's time is also compared with the whole prompt's. One thread; the
GGUFs go to --out. Prints one line per (precision, adapter scale)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from nearpolicy.config.schema import load_config
from nearpolicy.engines.base import LoraAdapter
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.engines.gguf.export import export_model_gguf
from nearpolicy.engines.gguf.lora_adapter import export_lora_gguf
from nearpolicy.model.load import chat_prompt_ids, load_policy
from nearpolicy.model.lora import attach_lora, load_engine_base
from nearpolicy.training.assemble import build_task
from nearpolicy.training.lora_sync import (PROBE_CONTEXT, PROBE_PROMPTS, engine_logprobs, policy_logprobs,
                                           probe_sequences)

SCALES = (0.0, 1e-3, 1e-2, 3e-2)  # std of lora_B's entries (lora_A: PEFT's Kaiming init); 0 = version 0


def measure(precision: str, out: Path, rank: int) -> None:
    cfg = load_config(None)
    model, tokenizer = load_policy("smollm2")
    model.float()
    folder = out / precision
    gguf = export_model_gguf(model, folder, precision, (), None, tokenizer)
    load_engine_base(model, gguf)
    lora = attach_lora(model, rank, 2.0 * rank, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"), 0, gguf)
    task = build_task(cfg)
    prompts = [chat_prompt_ids(tokenizer, cfg.task.system_prompt, task.train_problem(i).question)
               for i in range(PROBE_PROMPTS)]
    probe = probe_sequences(prompts, tokenizer)
    engine = build_engine(EngineRequest("llamacpp", precision, max_context=512, max_parallel_sequences=8, threads=1,
                                        adaptive_threads=False),
                          EngineInputs(gguf, model, workdir=folder, probe_prompt=prompts[0]))
    with lora.base_only():
        base = policy_logprobs(lora.model, probe)
    try:
        for version, scale in enumerate(SCALES):
            with torch.no_grad():
                for _, module in lora.lora_layers():
                    module.lora_B["default"].weight.normal_(0.0, scale)
            t0 = time.perf_counter()
            write_s = export_lora_gguf(lora.adapter_tensors(), model.config, folder / "adapter.gguf", lora.alpha)
            t1 = time.perf_counter()
            engine.update_weights(LoraAdapter(gguf=str(folder / "adapter.gguf"), scale=lora.scale), version)
            t2 = time.perf_counter()
            theirs, ours = engine_logprobs(engine, probe), policy_logprobs(lora.model, probe)
            t3 = time.perf_counter()
            gap = np.abs(theirs - ours)
            print(f"{precision} rank {rank} lora_B std {scale:g}: gap mean {gap.mean():.4f} max {gap.max():.4f} "
                  f"(|trainer - base| {np.abs(ours - base).mean():.4f}, |engine - base| "
                  f"{np.abs(theirs - base).mean():.4f}) over {len(gap)} tokens; write {write_s:.3f} s "
                  f"({t1 - t0:.3f}), update_weights {t2 - t1:.3f} s, proof {t3 - t2:.2f} s, adapter "
                  f"{(folder / 'adapter.gguf').stat().st_size / 2**20:.1f} MiB", flush=True)
        _time_contexts(engine, lora, prompts, probe, precision)
    finally:
        engine.close()


def _time_contexts(engine, lora, prompts, probe, precision: str, rounds: int = 5) -> None:
    """The proof's two forwards on the probe as trained (the prompt's last PROBE_CONTEXT tokens) against the whole
    prompt, alternated (ABAB) so that load on the machine hits both alike; prints each one's median seconds."""
    arms = {"whole prompt": [(list(p), c) for p, (_, c) in zip(prompts, probe)],
            f"last {PROBE_CONTEXT} prompt tokens": probe}
    seconds: dict[str, list[float]] = {label: [] for label in arms}
    for _ in range(rounds):
        for label, sequences in arms.items():
            started = time.perf_counter()
            engine_logprobs(engine, sequences), policy_logprobs(lora.model, sequences)
            seconds[label].append(time.perf_counter() - started)
    print(f"{precision} proof seconds (median of {rounds}, alternated): " + "; ".join(
        f"{label} ({sum(len(p) + len(c) for p, c in arms[label])} tokens) {statistics.median(s):.3f}"
        for label, s in seconds.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("precisions", nargs="+")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lora-proof"))
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for precision in args.precisions:
        measure(precision, args.out, args.rank)


if __name__ == "__main__":
    main()
