"""Why TRL's GRPO responses are longer than nearpolicy's (issue 39 item 2): response-length distributions of several
samplers on the same prompts, each prompt sampled S times, with cluster-by-prompt 95 % intervals.

    .venv-bench/bin/python bench/length_gap.py --out docs/bench/length-gap.json      # TRL's arm needs .venv-bench
    .venv/bin/python bench/length_gap.py --arms nearpolicy-llamacpp model-t1 --out /tmp/x.json

Prompts: the first P training problems of configs/main.toml's task (the GRPO bench's first steps), chat-templated
with the task's system prompt. Arms (--arms, each seeded):
- nearpolicy-llamacpp: nearpolicy's llama.cpp engine at configs/main.toml's precision (q8_0) and sampling transform
  (temperature, top_p, top_k; nearpolicy has no min_p and no repetition penalty), stop set = llama.cpp's
  end-of-generation ids; 32 sequences per decode batch, as one main-job step.
- nearpolicy-llamacpp-f32: the same engine on an f32 GGUF (quantization taken out, llama.cpp kept).
- nearpolicy-hf-fp32: nearpolicy's transformers engine in fp32 (the same sampler, torch's forward).
- model-t1: the fp32 model's own distribution, no library sampler: a plain loop, softmax at temperature 1, one
  prompt's S samples per batch (no padding), stop at the same stop set.
- generate-unpadded: transformers `generate` with TRL's generation config, one prompt's S samples per call (no padding).
- trl: TRL 1.16's own generation (GRPOTrainer._generate: its chat-template rendering, its GenerationConfig with the
  model's generation_config.json under it, left-padded batches of 32 rows, its completion mask), the trainer built by
  bench/trl_grpo.py; the logits processors transformers applied are recorded.
Lengths count the stop token; "truncated" = reached --limit without a stop. The mean's interval treats prompts as the
unit (per-prompt means, t with P - 1 df), and each arm's difference from the first arm is paired by prompt.

Training trajectories (optional): `--trl-runs` (bench/trl_grpo.py outputs, which hold each step's lengths) and
`--nearpolicy-runs` (metrics.jsonl of `nearpolicy train`) at the GRPO bench's settings are set beside the untrained
samplers: step k trains on problems (k - 1) x prompts_per_step .. k x prompts_per_step - 1, so each step's mean length
is compared with every arm's mean over those same problems (within the first --prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent


def mean_ci(per_prompt: list[list[float]]) -> dict:
    """Mean over prompts of each prompt's mean, with its 95 % half-width t_{0.975, P-1} x sd / sqrt(P) (prompts are
    the independent unit: one prompt's samples are correlated). P >= 2; raises ValueError otherwise."""
    from nearpolicy.ops.t_quantiles import t_quantile

    means = [statistics.fmean(xs) for xs in per_prompt]
    if len(means) < 2:
        raise ValueError("an interval needs at least 2 prompts")
    half = t_quantile(0.975, len(means) - 1) * statistics.stdev(means) / math.sqrt(len(means))
    return {"mean": statistics.fmean(means), "ci95": half}


def paired_difference(a: list[list[float]], b: list[list[float]]) -> dict:
    """Mean of a minus b over the same prompts (per-prompt means subtracted), with its paired 95 % half-width."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} prompts")
    return mean_ci([[statistics.fmean(x) - statistics.fmean(y)] for x, y in zip(a, b)])


def summary(lengths: list[list[int]], truncated: list[list[bool]]) -> dict:
    """An arm's figures: mean +- 95 % (by prompt), p50 / p90 (linear interpolation), truncated share, lengths."""
    from harness import quantile

    flat = [n for row in lengths for n in row]
    cut = [c for row in truncated for c in row]
    return {**mean_ci(lengths), "p50": quantile(flat, 0.5), "p90": quantile(flat, 0.9),
            "truncated_share": sum(cut) / len(cut), "n": len(flat), "lengths": lengths}


@dataclass
class Setup:
    cfg: object
    model: object
    tokenizer: object
    messages: list  # [P] chat messages (system, user)
    prompt_ids: list  # [P] nearpolicy's templated prompt ids
    stop_ids: set
    samples: int
    limit: int
    seed: int
    threads: int
    tmp: Path


def _engine_arm(st: Setup, config: str) -> tuple[list, list, dict]:
    from engine_for import open_engine

    from nearpolicy.training.assemble import sampling_params
    from nearpolicy.types import GenerationRequest

    engine = open_engine(config, st.model, st.tokenizer, st.tmp, 32, st.threads)
    sampling = replace(sampling_params(st.cfg), max_new_tokens=st.limit)
    try:
        rollouts = engine.generate([GenerationRequest(i, tuple(p), st.samples) for i, p in enumerate(st.prompt_ids)],
                                   sampling, seed=st.seed)
    finally:
        engine.close()
    rows = [rollouts[i * st.samples:(i + 1) * st.samples] for i in range(len(st.prompt_ids))]
    return ([[len(r.completion_ids) for r in row] for row in rows],
            [[r.finish_reason == "length" for r in row] for row in rows], {"sampling": vars(sampling)})


@torch.no_grad()
def _model_t1(st: Setup) -> tuple[list, list, dict]:
    """The plain loop: per prompt, S rows of the same prompt, KV cache, softmax at T = 1 in float64, multinomial."""
    model = st.model.eval()
    gen = torch.Generator().manual_seed(st.seed)
    lengths, truncated = [], []
    for prompt in st.prompt_ids:
        ids = torch.tensor([prompt] * st.samples)
        out = model(input_ids=ids, use_cache=True)
        n, done = [0] * st.samples, [False] * st.samples
        for _ in range(st.limit):
            probs = torch.softmax(out.logits[:, -1].double(), -1)
            tok = torch.multinomial(probs, 1, generator=gen)
            for r, t in enumerate(tok[:, 0].tolist()):
                if not done[r]:
                    n[r] += 1
                    done[r] = t in st.stop_ids
            if all(done):
                break
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        lengths.append(n)
        truncated.append([not d for d in done])
    return lengths, truncated, {}


def _stop_flags(completions, stops: set) -> list[bool]:
    return [not c or c[-1] not in stops for c in completions]


def _trl_generation_config(st: Setup):
    """The GenerationConfig TRL builds (trl_grpo.build_trainer's settings), for the unpadded generate arm."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=st.limit, do_sample=True, pad_token_id=st.tokenizer.pad_token_id,
                            bos_token_id=st.tokenizer.bos_token_id, eos_token_id=sorted(st.stop_ids),
                            temperature=st.cfg.sampling.temperature, top_p=1.0, top_k=0, min_p=None,
                            repetition_penalty=1.0, disable_compile=True)


@torch.no_grad()
def _generate_unpadded(st: Setup) -> tuple[list, list, dict]:
    torch.manual_seed(st.seed)
    config, lengths, truncated = _trl_generation_config(st), [], []
    for prompt in st.prompt_ids:
        ids = torch.tensor([prompt] * st.samples)
        out = st.model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        comps = [_until_stop(row[len(prompt):].tolist(), st.stop_ids) for row in out]
        lengths.append([len(c) for c in comps])
        truncated.append(_stop_flags(comps, st.stop_ids))
    return lengths, truncated, {}


def _until_stop(ids: list[int], stops: set) -> list[int]:
    """The completion up to and including its first stop id (generate pads finished rows)."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i + 1]
    return ids


def _trl(st: Setup, model_dir: str) -> tuple[list, list, dict]:
    """TRL's GRPOTrainer._generate on batches of 32 rows (8 prompts x S samples, each prompt S times in a row)."""
    from trl_grpo import build_trainer, load_model

    from nearpolicy.training.assemble import build_task

    model, tokenizer = load_model(model_dir)
    processors: dict = {"generate_calls": 0, "last": []}  # the logits processors transformers applied
    inner = model._get_logits_processor

    def recorded(*args, **kwargs):
        out = inner(*args, **kwargs)
        processors["generate_calls"] += 1
        processors["last"] = [f"{type(p).__name__}{ {k: v for k, v in vars(p).items() if not k.startswith('_')} }"
                              for p in out]
        return out

    model._get_logits_processor = recorded
    per_batch = 32 // st.samples
    trainer = build_trainer(st.cfg, build_task(st.cfg), model, tokenizer, str(st.tmp / "trl"), steps=1,
                            prompts=per_batch, group=st.samples, new_tokens=st.limit, micro_batch=st.samples)
    torch.manual_seed(st.seed)
    lengths, truncated, same_prompts = [], [], True
    for b in range(0, len(st.messages), per_batch):
        chunk = st.messages[b:b + per_batch]
        prompt_ids, completion_ids = trainer._generate([m for m in chunk for _ in range(st.samples)])[:2]
        same_prompts &= all(list(p) == list(st.prompt_ids[b + i // st.samples]) for i, p in enumerate(prompt_ids))
        for i in range(len(chunk)):
            comps = completion_ids[i * st.samples:(i + 1) * st.samples]
            lengths.append([len(c) for c in comps])
            truncated.append(_stop_flags(comps, set(trainer.eos_token_ids)))
    return lengths, truncated, {"logits_processors": processors, "prompt_ids_equal_nearpolicy": same_prompts,
                                "eos_token_ids": list(trainer.eos_token_ids),
                                "generation_config": trainer.generation_config.to_diff_dict()}


ARMS = ("nearpolicy-llamacpp", "nearpolicy-llamacpp-f32", "nearpolicy-hf-fp32", "model-t1", "generate-unpadded", "trl")


def run_arm(name: str, st: Setup, model_dir: str) -> tuple[list, list, dict]:
    if name == "nearpolicy-llamacpp":
        return _engine_arm(st, f"llamacpp:{st.cfg.engine.precision}")
    if name == "nearpolicy-llamacpp-f32":
        return _engine_arm(st, "llamacpp:f32")
    if name == "nearpolicy-hf-fp32":
        return _engine_arm(st, "hf:fp32")
    if name == "model-t1":
        return _model_t1(st)
    if name == "generate-unpadded":
        return _generate_unpadded(st)
    return _trl(st, model_dir)


def trajectories(args, arms: dict, per_step: int) -> dict:
    """Per-step mean response length of each given training run (its steps whose problems the arms sampled), beside
    each arm's untrained mean over the same step's problems."""
    runs = {}
    for path in args.trl_runs:
        runs[f"trl {Path(path).name}"] = [statistics.fmean(xs) for xs in json.loads(Path(path).read_text())["lengths"]]
    for path in args.nearpolicy_runs:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        runs[f"nearpolicy {Path(path).parent.name}"] = [r["response/length_mean"] for r in rows
                                                         if "response/length_mean" in r]
    covered = min(len(a["lengths"]) for a in arms.values()) // per_step  # steps whose problems the arms sampled
    runs = {name: steps[:covered] for name, steps in runs.items()}
    steps = max((len(v) for v in runs.values()), default=0)
    base = {name: [statistics.fmean(n for row in a["lengths"][k * per_step:(k + 1) * per_step] for n in row)
                   for k in range(steps)]
            for name, a in arms.items()}
    return {"runs": runs, "untrained": base}


def setup(args, tmp: Path) -> Setup:
    from nearpolicy.config.schema import load_config
    from nearpolicy.model.load import chat_prompt_ids, default_model_gguf, load_policy, stop_token_ids
    from nearpolicy.training.assemble import build_task

    cfg = load_config(Path(args.config), args.set)
    task = build_task(cfg)
    model, tokenizer = load_policy(cfg.model.path)
    questions = [task.train_problem(i).question for i in range(args.prompts)]
    messages = [[{"role": "system", "content": cfg.task.system_prompt}, {"role": "user", "content": q}]
                for q in questions]
    prompt_ids = [chat_prompt_ids(tokenizer, cfg.task.system_prompt, q) for q in questions]
    stops = stop_token_ids(model, tokenizer, default_model_gguf(), tmp / "vocab")
    return Setup(cfg, model, tokenizer, messages, prompt_ids, stops, args.samples,
                 args.limit or cfg.sampling.max_new_tokens, args.seed, args.threads, tmp)


def sample_arms(args) -> dict:
    """The result of sampling every arm of args.arms (module docstring), printed as it goes."""
    from nearpolicy.doctor import cpu_model

    with tempfile.TemporaryDirectory() as tmp:
        st = setup(args, Path(tmp))
        if "trl" in args.arms and not (Path(args.model_dir) / "config.json").is_file():
            st.model.save_pretrained(args.model_dir)  # as bench/workers.py export-hf
            st.tokenizer.save_pretrained(args.model_dir)
        arms = {}
        for name in args.arms:
            lengths, truncated, info = run_arm(name, st, args.model_dir)
            arms[name] = summary(lengths, truncated) | info
            arms[name]["minus_first_arm"] = paired_difference(lengths, arms[args.arms[0]]["lengths"])
            a = arms[name]
            print(f"{name}: mean {a['mean']:.1f} +- {a['ci95']:.1f}, p50 {a['p50']:.0f}, p90 {a['p90']:.0f}, "
                  f"truncated {a['truncated_share']:.2f}; minus {args.arms[0]}: {a['minus_first_arm']['mean']:+.1f} "
                  f"+- {a['minus_first_arm']['ci95']:.1f}", flush=True)
    return {"commands": ["bench/length_gap.py " + " ".join(sys.argv[1:])], "cpu": cpu_model(),
            "python": platform.python_version(), "prompts": args.prompts, "samples": args.samples, "limit": st.limit,
            "seed": args.seed, "config": args.config, "set": args.set, "arms": arms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=["nearpolicy-llamacpp", "trl", "model-t1", "nearpolicy-hf-fp32"],
                   choices=ARMS, help="the first is the reference of the paired differences")
    p.add_argument("--config", default="configs/main.toml")
    p.add_argument("--set", action="append", default=[], help="config overrides, as for `nearpolicy train`")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (32 must be a multiple: TRL's batch)")
    p.add_argument("--limit", type=int, default=None, help="token limit (default: the config's max_new_tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", default=str(ROOT / "bench/.cache/smollm2-hf"),
                   help="TRL's HF folder (made if absent)")
    p.add_argument("--trl-runs", nargs="*", default=[], help="bench/trl_grpo.py outputs (module docstring)")
    p.add_argument("--nearpolicy-runs", nargs="*", default=[], help="metrics.jsonl files (module docstring)")
    p.add_argument("--arms-from", type=Path, default=None,
                   help="an earlier output: keep its arms (no sampling), add the trajectories")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.arms_from is None:
        result = sample_arms(args)
    else:
        result = json.loads(args.arms_from.read_text())
        result["commands"] = result.get("commands", [result.pop("command", "")]) + [
            "bench/length_gap.py " + " ".join(sys.argv[1:])]
    if args.trl_runs or args.nearpolicy_runs:
        from nearpolicy.config.schema import load_config

        per_step = load_config(Path(args.config), args.set).algorithm.prompts_per_step
        result["trajectories"] = trajectories(args, result["arms"], per_step)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
