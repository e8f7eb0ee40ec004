"""One measurement per process (so peak RSS is per configuration); run_all.py starts these.

    python bench/workers.py gemm      --out R.json --threads 2 --repeats 3 --n 2048
    python bench/workers.py rollout   --out R.json --config llamacpp:q8_0 --prompts 4 --group 8 --new-tokens 128 ...
    python bench/workers.py trainer   --out R.json --batch 8 --seq-len 128 ...
    python bench/workers.py export-hf --out R.json --dir bench/.cache/smollm2-hf

Rollout configurations: `llamacpp:<precision>` and `hf:fp32` / `hf:bf16` are nearpolicy engines (per-token log-probs from
the sampling loop). `transformers-generate` is `model.generate` configured as TRL's GRPOTrainer configures it
without vLLM (do_sample, temperature 1, top_p 1, top_k 0, the prompts repeated G times, left padding, one
batch); generate returns no log-probs. `transformers-generate+logprobs` adds what TRL does to get them: one
teacher-forced forward pass over prompt + completion in micro-batches (log-softmax, gather).
Each worker writes one JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _task_prompts(tokenizer, prompts: int) -> list[list[int]]:
    from nearpolicy.config.schema import TaskConfig
    from nearpolicy.model.load import chat_prompt_ids
    from nearpolicy.tasks import make_task

    tc = TaskConfig()
    task = make_task("reasoning_gym", name="chain_sum", options=tc.resolved_options(), path=None, train_size=200,
                     eval_size=prompts, seed=0, eval_seed=1234, skip_bad_lines=False)
    return [chat_prompt_ids(tokenizer, tc.system_prompt, p.question) for p in task.eval_problems()]


def gemm(args) -> dict:
    n = args.n
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b  # warm-up
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.inner):
            a @ b
        rates.append(2.0 * n**3 * args.inner / (time.perf_counter() - t0) / 1e9)
    return {"n": n, "gflops_runs": rates}


class _NearpolicyRollout:
    def __init__(self, config: str, model, tokenizer, args, tmp: Path):
        from engine_for import open_engine  # bench/engine_for.py (bench/ is on the path of `python bench/workers.py`)

        self.engine = open_engine(config, model, tokenizer, tmp, args.prompts * args.group, args.threads)

    def run(self, prompts, group, new_tokens, seed) -> int:
        from nearpolicy.types import GenerationRequest, SamplingParams

        requests = [GenerationRequest(i, tuple(p), group) for i, p in enumerate(prompts)]
        rollouts = self.engine.generate(requests, SamplingParams(1.0, 1.0, 0, new_tokens), seed=seed)
        assert all(len(r.rollout_logprobs) == len(r.completion_ids) for r in rollouts)
        return sum(len(r.completion_ids) for r in rollouts)


class _Generate:
    """transformers generate as TRL's GRPOTrainer calls it without vLLM; optionally TRL's log-prob forward."""

    def __init__(self, model, tokenizer, with_logprobs: bool, micro_batch: int):
        from transformers import GenerationConfig

        from nearpolicy.model.load import default_model_gguf
        from nearpolicy.model.load import stop_token_ids

        self.model = model.eval()
        with tempfile.TemporaryDirectory() as tmp:
            self.eos = sorted(stop_token_ids(model, tokenizer, default_model_gguf(), Path(tmp)))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        self.gen = lambda n: GenerationConfig(max_new_tokens=n, do_sample=True, pad_token_id=self.pad,
                                              bos_token_id=tokenizer.bos_token_id, eos_token_id=self.eos,
                                              temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                                              repetition_penalty=1.0, disable_compile=True)
        self.with_logprobs, self.micro_batch = with_logprobs, micro_batch

    @torch.no_grad()
    def run(self, prompts, group, new_tokens, seed) -> int:
        torch.manual_seed(seed)
        rows = [p for p in prompts for _ in range(group)]  # TRL's RepeatSampler: each prompt G times
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(rows):  # left padding, as TRL's processing class pads prompts
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        out = self.model.generate(input_ids=ids, attention_mask=attn, generation_config=self.gen(new_tokens))
        completion = out[:, width:]
        is_eos = torch.isin(completion, torch.tensor(self.eos))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(rows),), completion.shape[1]))
        cmask = torch.arange(completion.shape[1])[None] <= first[:, None]
        if self.with_logprobs:
            full_mask = torch.cat([attn, cmask.long()], 1)
            k = completion.shape[1]
            for s in range(0, len(rows), self.micro_batch):  # TRL: forward in per_device_train_batch_size chunks
                sl = slice(s, s + self.micro_batch)
                logits = self.model(input_ids=out[sl], attention_mask=full_mask[sl], logits_to_keep=k + 1).logits[:, :-1]
                torch.log_softmax(logits.float(), -1).gather(-1, completion[sl, :, None])
        return int(cmask.sum())


def rollout(args) -> dict:
    from nearpolicy.model.load import load_policy

    model, tokenizer = load_policy("smollm2")
    prompts = _task_prompts(tokenizer, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        if args.config.startswith("transformers-generate"):
            runner = _Generate(model, tokenizer, args.config.endswith("+logprobs"), args.micro_batch)
        else:
            runner = _NearpolicyRollout(args.config, model, tokenizer, args, Path(tmp))
        runner.run(prompts[:1], 1, 8, seed=12345)  # warm-up
        forward = _time_forward(runner)
        forward[2].clear()  # decode-step sizes from the timed runs only
        rates, tokens, total = [], [], 0.0
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            n = runner.run(prompts, args.group, args.new_tokens, seed=rep)
            total += time.perf_counter() - t0
            rates.append(n / (time.perf_counter() - t0))
            tokens.append(n)
    profile = {"forward_s": forward[0], "total_s": total, "forward": forward[1], "decode_steps": forward[2]}
    return {"tokens_per_s_runs": rates, "tokens_runs": tokens, "profile": profile}


def _time_forward(runner) -> list:
    """Wrap the model-evaluation call (llama.cpp `_decode`, the hf engine's stepper, or the torch model's forward)
    with a timer; returns a list whose [0] accumulates its seconds; [1] names what was timed; [2] (llama.cpp and
    hf) maps the sequences of one decode call (one token each; hf: the rows of its batch, finished ones not yet
    compacted away included) to [calls, seconds], the prompt prefill excluded. The rest of a run is sampling,
    log-prob extraction and bookkeeping in Python / numpy / torch."""
    acc = [0.0, "", {}]
    engine = getattr(runner, "engine", None)

    def count_step(sequences: int, seconds: float) -> None:
        calls = acc[2].setdefault(sequences, [0, 0.0])
        calls[0] += 1
        calls[1] += seconds

    if engine is not None and hasattr(engine, "_sampler"):  # llama.cpp: every decode call is a KVContext.decode
        from nearpolicy.engines.llama_context import KVContext

        def count_decode(a, seconds):
            entries = next((x for x in a if isinstance(x, list)), None)  # (self, entries) on the class
            if entries is not None and len({seq for _, _, seq, _ in entries}) == len(entries):  # one token a sequence
                count_step(len(entries), seconds)

        acc[1] = "llama_decode (llama.cpp forward, logits copy)"
        KVContext.decode = _timed(KVContext.decode, acc, count_decode)
    elif engine is not None and hasattr(engine, "_stepper"):  # the hf engine: prefill, decode steps, compaction
        stepper = engine._stepper
        acc[1] = f"{type(stepper).__name__} start + step + keep (torch forward, logits, compaction)"
        stepper.keep = _timed(stepper.keep, acc)
        stepper.start = _timed(stepper.start, acc)
        stepper.step = _timed(stepper.step, acc, lambda a, seconds: count_step(len(a[0]), seconds))  # rows of the batch
    else:
        acc[1] = "torch model forward"
        runner.model.forward = _timed(runner.model.forward, acc)
    return acc


_timing_depth = [0]  # timed calls in progress: a timed call inside another (start's own keep) is not added twice


def _timed(fn, acc: list, record=None):
    """`fn` with its seconds added to acc[0] (outermost timed calls only) and passed to record(args, seconds)."""

    def timed(*a, **k):
        t0 = time.perf_counter()
        _timing_depth[0] += 1
        try:
            return fn(*a, **k)
        finally:
            _timing_depth[0] -= 1
            seconds = time.perf_counter() - t0
            acc[0] += seconds if _timing_depth[0] == 0 else 0.0
            if record is not None:
                record(a, seconds)

    return timed


def trainer(args) -> dict:
    from nearpolicy.model.load import load_policy

    model, _ = load_policy("smollm2")
    model.train()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay put across repeats
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)

    def fwd_bwd():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-logp.mean()).backward()
        opt.zero_grad(set_to_none=True)

    fwd_bwd()  # warm-up
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.inner):
            fwd_bwd()
        rates.append(args.batch * args.seq_len * args.inner / (time.perf_counter() - t0))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd_bwd()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    top = [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total}
           for e in events[:10]]
    return {"tokens_per_s_runs": rates, "parameters": params, "profile": top, "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size, "batch": args.batch, "seq_len": args.seq_len}


def export_hf(args) -> dict:
    """The fp32 SmolLM2 (dequantized from the shipped GGUF) as an HF folder, for TRL; skipped when present."""
    from nearpolicy.model.load import load_policy

    out = Path(args.dir)
    if not (out / "config.json").is_file():
        model, tokenizer = load_policy("smollm2")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return {"dir": str(out)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["gemm", "rollout", "trainer", "export-hf"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inner", type=int, default=1, help="gemm / trainer: operations per timed run")
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--config", default="llamacpp:q8_0")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dir", default="bench/.cache/smollm2-hf")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {"gemm": gemm, "rollout": rollout, "trainer": trainer, "export-hf": export_hf}[args.kind](args)
    args.out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
