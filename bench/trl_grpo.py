"""TRL's GRPOTrainer on the nearpolicy main job's settings; runs in the benchmark environment (.venv-bench,
`pip install -e '.[bench]'`), started by run_all.py. Writes {"step_s_runs": [...], "trl": version} to --out.

Same as `nearpolicy train configs/main.toml`: SmolLM2-135M-Instruct in fp32 (the HF folder export-hf wrote from
the shipped GGUF), the same chain_sum training problems in the same order (nearpolicy's task code, no shuffle),
the same chat-templated prompts (system prompt + question), the same reward (nearpolicy's task scorer), G,
prompts per step, micro-batch (per_device_train_batch_size; gradient accumulation = prompts x G / micro-batch,
one generation batch per optimizer step), max new tokens, temperature 1, lr, AdamW betas and weight decay,
gradient clipping, clip epsilon 0.2 / 0.28, beta 0 (no reference model), constant learning rate, the same stop
ids (nearpolicy's end-of-generation set). Generation is transformers `generate` (use_vllm=False) on the CPU. A step is timed from on_step_begin to on_step_end.
With algorithm.trainer_precision = "bf16" among the overrides, GRPOConfig(bf16=True): accelerate's CPU autocast,
fp32 weights, nearpolicy's bf16 update counterpart (run_all.py --trainer-precision bf16).

`--min-new-tokens L` (the harness's equal-length arm, with --new-tokens L): transformers' min_new_tokens masks every
stop id for the first L tokens, so every response is exactly L tokens, all of them trained (TRL's completion mask ends
at the first stop id, and there is none). The output also holds each step's completion lengths ("lengths") and which
completions hit the token limit without a stop id ("truncated"), one list per generation batch (= optimizer step).
`build_trainer` is shared with bench/length_gap.py, which samples from TRL's own generation path.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def load_model(model_dir: str):
    """(model, tokenizer) of the fp32 HF folder, the model's generation config stopping at nearpolicy's stop ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nearpolicy.model.load import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # nearpolicy's stop set (llama.cpp's end-of-generation ids, SmolLM2: {0, 2, 4}): TRL stops at the generation
    # config's eos ids plus the tokenizer's eos, which for this export is 2 only, and would run on past the others
    with tempfile.TemporaryDirectory() as vocab_dir:
        model.generation_config.eos_token_id = sorted(stop_token_ids(model, tokenizer, None, Path(vocab_dir)))
    return model, tokenizer


def build_trainer(cfg, task, model, tokenizer, out_dir: str, *, steps: int, prompts: int, group: int, new_tokens: int,
                  micro_batch: int, min_new_tokens: int = 0, seed: int | None = None, callbacks=()):
    """TRL's GRPOTrainer on the main job's settings (module docstring) over the first steps x prompts training
    problems, as chat messages (system prompt + question); min_new_tokens > 0 goes to generate (equal length); `seed`:
    TRL's own seed (its sampling), default run.seed (which also seeds the problems)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from nearpolicy.tasks import safe_score

    t, a = cfg.task, cfg.algorithm
    rows = [{"prompt": [{"role": "system", "content": t.system_prompt},
                        {"role": "user", "content": task.train_problem(i).question}], "index": i}
            for i in range(steps * prompts)]

    def reward(completions, index, **_):
        return [safe_score(task, c[0]["content"], task.train_problem(i))[0] for c, i in zip(completions, index)]

    samples = prompts * group
    if samples % micro_batch:
        raise SystemExit(f"prompts x G = {samples} must be a multiple of the micro-batch {micro_batch}")
    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=a.trainer_precision == "bf16", fp16=False, report_to="none",
        save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=steps, seed=cfg.run.seed if seed is None else seed,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=samples // micro_batch,
        num_generations=group, max_completion_length=new_tokens, temperature=cfg.sampling.temperature,
        top_p=1.0, top_k=0, use_vllm=False, shuffle_dataset=False, learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=a.weight_decay, adam_beta1=a.adam_betas[0],
        adam_beta2=a.adam_betas[1], max_grad_norm=a.max_grad_norm, beta=0.0, epsilon=a.clip_low,
        epsilon_high=a.clip_high, loss_type="dapo", num_iterations=1, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": min_new_tokens} if min_new_tokens else None,
    )
    return GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                       processing_class=tokenizer, callbacks=list(callbacks))


def record_completions(trainer) -> dict[str, list]:
    """Wrap the trainer's generation: each call appends its completions' lengths (tokens, stop id included) to
    "lengths" and whether each ended without a stop id (cut at the limit) to "truncated"; returns that dict."""
    out: dict[str, list] = {"lengths": [], "truncated": []}
    generate = trainer._generate_single_turn  # TRL 1.16.0 (pinned by nearpolicy[bench])
    stops = set(trainer.eos_token_ids)

    def recorded(*args, **kwargs):
        completion_ids, logprobs = generate(*args, **kwargs)
        out["lengths"].append([len(c) for c in completion_ids])
        out["truncated"].append([not c or c[-1] not in stops for c in completion_ids])
        return completion_ids, logprobs

    trainer._generate_single_turn = recorded
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--config", default="configs/main.toml")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--min-new-tokens", type=int, default=0, help="> 0: no stop before this many tokens (equal length)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="TRL's seed (its samples); default run.seed, same problems")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="config overrides, as for `nearpolicy train`")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import trl
    from transformers import TrainerCallback

    from nearpolicy.config.schema import load_config
    from nearpolicy.training.assemble import build_task

    cfg = load_config(Path(args.config), args.set)
    model, tokenizer = load_model(args.model_dir)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trainer(cfg, build_task(cfg), model, tokenizer, out_dir, steps=args.steps, prompts=args.prompts,
                                group=args.group, new_tokens=args.new_tokens, micro_batch=args.micro_batch,
                                min_new_tokens=args.min_new_tokens, seed=args.seed, callbacks=[StepTimer()])
        completions = record_completions(trainer)
        trainer.train()
        logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    batch = {"response_tokens": [h["completions/mean_length"] for h in logged],
             "zero_advantage_rows": [h.get("frac_reward_zero_std", float("nan")) for h in logged]}
    args.out.write_text(json.dumps({"step_s_runs": times, "batch": batch, "trl": trl.__version__,
                                    "eos_token_ids": model.generation_config.eos_token_id, **completions}) + "\n")


if __name__ == "__main__":
    main()
