"""`nearpolicy diagnose`: measure the noise floor and every candidate, set the budget, give verdicts, and
optionally scan per-layer sensitivity and propose mixed-precision recipes. Writes diagnose.json / .csv and PNGs."""

from __future__ import annotations

import csv
import io
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from nearpolicy.config.schema import Config
from nearpolicy.diagnosis.admission import Budget, admitted, make_budget, propose_recipe, verdict_line
from nearpolicy.diagnosis.candidates import RolloutCandidate, parse_candidate
from nearpolicy.diagnosis.measure import CandidateResult, DiagnoseContext, measure_candidate
from nearpolicy.diagnosis.plots import position_chart, sensitivity_chart
from nearpolicy.diagnosis.sensitivity import reference_samples, scan
from nearpolicy.engines.factory import ENGINES
from nearpolicy.engines.gguf.export import TENSOR_PRECISIONS
from nearpolicy.model.load import load_model_weights
from nearpolicy.runs.folder import write_json
from nearpolicy.files import write_atomically

DEFAULT_CANDIDATES = ("llamacpp:f32", "llamacpp:f16", "llamacpp:q8_0", "llamacpp:q4_1", "llamacpp:mxfp4", "hf:bf16")
FLOOR = "llamacpp:f32,kv_cache=f32"


@dataclass
class DiagnoseSettings:
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    prompts: int = 16
    group_size: int = 4
    out: Path = Path("runs/diagnose")
    weights: Path | None = None  # a checkpoint folder whose model.safetensors replaces model.path's weights
    budget_k3: float | None = None
    budget_floor_multiple: float | None = None
    budget_seq_ess: float = 0.5
    sensitivity: list[str] = field(default_factory=list)  # precisions to scan
    sensitivity_prompts: int = 8  # the scan is paired (teacher-forced), so fewer prompts suffice
    propose: bool = False
    promote_to: str = "f16"
    recipe_rounds: int = 4
    progress: bool = True


def run_diagnosis(cfg: Config, settings: DiagnoseSettings, log=print) -> tuple[dict, int]:
    """Measure, decide and write the outputs. Returns (the JSON report, whose table and verdicts `markdown_table`
    writes; exit code: 0 when every candidate is admitted, 1 otherwise). Raises ValueError for a bad candidate
    string (before any model is loaded)."""
    candidates = [parse_candidate(c) for c in settings.candidates]
    floor = parse_candidate(FLOOR)
    _check_settings(cfg, settings)
    ctx = _context(cfg, settings, log)
    try:
        return _diagnose(cfg, settings, ctx, floor, candidates, log)
    finally:
        shutil.rmtree(ctx.workdir, ignore_errors=True)  # only the scratch folder this run made


def _check_settings(cfg: Config, settings: DiagnoseSettings) -> None:
    """Every bad setting fails here, before any model is loaded or sample drawn."""
    if settings.prompts < 1 or settings.group_size < 1:
        raise ValueError(f"--prompts and --group must be >= 1, got {settings.prompts}, {settings.group_size}")
    if settings.sensitivity_prompts < 1:
        raise ValueError(f"--sensitivity-prompts must be >= 1, got {settings.sensitivity_prompts}")
    if settings.group_size > cfg.engine.max_parallel_sequences:
        raise ValueError(f"--group {settings.group_size} exceeds engine.max_parallel_sequences "
                         f"({cfg.engine.max_parallel_sequences}): a group is decoded in one batch")
    make_budget(1e-9, cfg.sampling.max_new_tokens, absolute=settings.budget_k3,
                floor_multiple=settings.budget_floor_multiple, seq_ess_min=settings.budget_seq_ess)
    out = Path(settings.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")


def _diagnose(cfg: Config, settings: DiagnoseSettings, ctx: DiagnoseContext, floor: RolloutCandidate,
              candidates: list[RolloutCandidate], log) -> tuple[dict, int]:
    bar = tqdm(total=(len(candidates) + 1) * len(ctx.prompts) * ctx.group_size, desc="diagnose sampling",
               disable=not settings.progress, dynamic_ncols=True, unit="sample")
    floor_result = measure_candidate(ctx, floor, bar.update)
    floor_result.candidate = f"floor: {FLOOR}"
    results = []
    for c in candidates:
        bar.set_postfix_str(c.name)
        results.append(measure_candidate(ctx, c, bar.update))
    bar.close()
    budget = make_budget(floor_result.metrics["k3"], cfg.sampling.max_new_tokens, absolute=settings.budget_k3,
                         floor_multiple=settings.budget_floor_multiple, seq_ess_min=settings.budget_seq_ess)
    if floor_result.metrics["k3"] > budget.k3:
        log(f"warning: the noise floor k3 {floor_result.metrics['k3']:.3g} exceeds the budget {budget.k3:.3g}")
    verdicts = [admitted(r.metrics["k3"], budget) for r in results]
    scans = {p: _scan(ctx, p, floor, settings) for p in settings.sensitivity}
    recipes = []
    if settings.propose:
        for c, ok in zip(candidates, verdicts):
            if (not ok and "tensor_precision" in ENGINES[c.engine].options and not c.tensor_precision
                    and c.precision in TENSOR_PRECISIONS):  # a K-quant takes no per-tensor promotions
                if c.precision not in scans:  # one scan per precision, shared by its candidates
                    scans[c.precision] = _scan(ctx, c.precision, floor, settings)
                recipes.append(_find_recipe(ctx, c, scans[c.precision], budget, settings, log))
    report = _report(cfg, settings, ctx, floor_result, results, verdicts, budget, scans, recipes)
    _write(settings.out, report, floor_result, results, verdicts, scans)
    return report, 0 if all(verdicts) else 1


def _context(cfg: Config, settings: DiagnoseSettings, log) -> DiagnoseContext:
    import torch

    from nearpolicy.model.load import chat_prompt_ids, load_policy, resolve_model
    from nearpolicy.training.assemble import build_task, sampling_params

    torch.set_num_threads(cfg.run.threads)
    from nearpolicy.model.identity import check_support, model_facts
    from nearpolicy.model.templates import use_chat_template

    resolved = resolve_model(cfg.model.path)
    check_support(model_facts(resolved), cfg)
    task = build_task(cfg)  # before the model loads: a bad task.path or task.name fails in seconds
    model, tokenizer = load_policy(cfg.model.path)
    use_chat_template(tokenizer, cfg.model.chat_template)
    model.float().eval().requires_grad_(False)
    if settings.weights is not None:
        load_model_weights(settings.weights, model)
        log(f"weights from {settings.weights}")
    prompts = [chat_prompt_ids(tokenizer, cfg.task.system_prompt, task.train_problem(i).question, cfg.task.example)
               for i in range(settings.prompts)]
    sampling = sampling_params(cfg)
    Path(settings.out).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".diagnose-engine-", dir=settings.out))  # scratch GGUFs, removed at the end
    return DiagnoseContext(model, tokenizer, resolved.path if resolved.kind == "gguf" else None, prompts,
                           settings.group_size, sampling, workdir, cfg.run.seed, cfg.run.threads,
                           cfg.model.max_context, cfg.algorithm.micro_batch_size,
                           max_parallel=cfg.engine.max_parallel_sequences,
                           vllm_kv_cache_gib=cfg.engine.vllm_kv_cache_gib,
                           trainer_precision=cfg.algorithm.trainer_precision)


def _scan(ctx: DiagnoseContext, precision: str, reference: RolloutCandidate, settings: DiagnoseSettings) -> dict:
    ctx = replace(ctx, prompts=ctx.prompts[: settings.sensitivity_prompts])
    samples = reference_samples(ctx, reference)
    base, full, units = scan(ctx, precision, reference, samples, settings.progress)
    return {"precision": precision, "reference": reference.spec(), "sequences": len(samples.prompts),
            "reference_k3": base, "full_k3": full,
            "units": [asdict(u) for u in units], "_units": units}


def _find_recipe(ctx: DiagnoseContext, candidate: RolloutCandidate, scanned: dict, budget: Budget,
                 settings: DiagnoseSettings, log) -> dict:
    """Propose, verify by sampling, and promote more units until the recipe is admitted (bounded rounds)."""
    attempts = []
    for extra in range(settings.recipe_rounds):
        recipe = propose_recipe(candidate.precision, scanned["reference_k3"], scanned["full_k3"], scanned["_units"],
                                0.8 * budget.k3, settings.promote_to, skip=extra)
        if recipe is None:
            break
        trial = candidate.with_overrides(recipe.overrides)
        result = measure_candidate(ctx, trial)
        ok = admitted(result.metrics["k3"], budget)
        attempts.append({"spec": trial.spec(), "promoted": list(recipe.promoted), "predicted_k3": recipe.predicted_k3,
                         "measured_k3": result.metrics["k3"], "extra_bytes": recipe.extra_bytes, "admitted": ok})
        log(f"recipe {trial.spec()}: k3 {result.metrics['k3']:.3g} ({'admitted' if ok else 'rejected'})")
        if ok:
            break
    found = next((a for a in attempts if a["admitted"]), None)
    return {"candidate": candidate.spec(), "recipe": found, "attempts": attempts}


def _report(cfg, settings, ctx, floor_result, results, verdicts, budget, scans, recipes) -> dict:
    return {
        "model": cfg.model.path, "weights": str(settings.weights) if settings.weights else None,
        "task": {"kind": cfg.task.kind, "name": cfg.task.name, "options": cfg.task.resolved_options()},
        "prompts": len(ctx.prompts), "group_size": ctx.group_size, "sampling": asdict(ctx.sampling),
        "floor": floor_result.row(), "budget": asdict(budget),
        "candidates": [r.row() | {"admitted": ok, "by_position": r.by_position} for r, ok in zip(results, verdicts)],
        "all_admitted": all(verdicts),
        "sensitivity": {p: {k: v for k, v in s.items() if not k.startswith("_")} for p, s in scans.items()},
        "recipes": recipes,
    }


COLUMNS = ("candidate", "weights", "k1", "k3", "k3_se", "aligned_k3", "aligned_k3_se", "chi2", "ess", "seq_ess", "abs_logprob_diff_p50", "abs_logprob_diff_p90",
           "abs_logprob_diff_p99", "abs_logprob_diff_max", "frac_ratio_outside_0.5_2", "prob_corr",
           "seq_training_ppl", "seq_rollout_ppl", "seq_log_ppl_diff", "seq_log_ppl_abs_diff", "seq_log_ppl_diff_max",
           "seq_log_ppl_diff_min", "seq_ppl_ratio", "seq_chi2", "seq_empty_count", "tokens", "mean_response_tokens",
           "tokens_per_s")


def _write(out: Path, report: dict, floor_result: CandidateResult, results: list[CandidateResult], verdicts, scans) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "diagnose.json", report)
    rows = [floor_result.row() | {"admitted": ""}] + [r.row() | {"admitted": ok} for r, ok in zip(results, verdicts)]
    _write_csv(out / "diagnose.csv", rows, [*COLUMNS, "admitted"])
    position_chart([floor_result, *results], out / "position.png")
    for precision, s in scans.items():
        _write_csv(out / f"sensitivity-{precision}.csv", s["units"], ["unit", "kind", "k3", "added_k3", "parameters"])
        sensitivity_chart(s["_units"], precision, "f32", out / f"sensitivity-{precision}.png")


def _write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, buffer.getvalue())


def markdown_table(report: dict) -> str:
    """The verdict table as markdown, the per-sequence table (sequence_table), then one line per candidate saying why
    it is admitted or rejected in the budget's terms, then the proposed recipes (what the command prints on stdout)."""
    b = report["budget"]
    lines = [f"budget: {b['rule']} (noise floor k3 {b['floor_k3']:.3g})", "",
             "| candidate | weights | k3 (± s.e.) | aligned k3 | k1 | chi2 | ESS | seq ESS | p99 abs dlogp | max abs dlogp | "
             "outside [0.5,2] | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [report["floor"] | {"admitted": None}] + report["candidates"]
    for r in rows:
        verdict = "floor" if r["admitted"] is None else ("admitted" if r["admitted"] else "REJECTED")
        if r["admitted"] is not None and abs(r["k3"] - b["k3"]) < 2 * r["k3_se"]:
            verdict += " (borderline: within 2 s.e. of the budget; sample more with --prompts)"
        aligned = f"{r['aligned_k3']:.3g} ± {r['aligned_k3_se']:.1g}" if "aligned_k3" in r else "-"
        lines.append(f"| {r['candidate']} | {r['weights']} | {r['k3']:.3g} ± {r['k3_se']:.1g} | {aligned} | {r['k1']:.3g} | {r['chi2']:.3g} | "
                     f"{r['ess']:.4f} | {r['seq_ess']:.3f} | {r['abs_logprob_diff_p99']:.3g} | "
                     f"{r['abs_logprob_diff_max']:.3g} | {r['frac_ratio_outside_0.5_2']:.2%} | {verdict} |")
    lines += ["", *sequence_table(rows)]
    budget = Budget(**b)
    lines += ["", *(f"- {verdict_line(r['candidate'], r['k3'], budget)}" for r in report["candidates"])]
    for rec in report["recipes"]:
        found = rec["recipe"]
        lines.append(f"\nproposed for {rec['candidate']}: " + (f"{found['spec']} (k3 {found['measured_k3']:.3g}, "
                     f"+{found['extra_bytes'] / 1e6:.1f} MB)" if found else "no recipe within the budget"))
    return "\n".join(lines)


def sequence_table(rows: list[dict]) -> list[str]:
    """Markdown lines of the per-sequence metrics (seq_*, verl's rollout_corr names in the README), one row per
    candidate; d = log PPL trainer - log PPL engine (nats / token), > 0 where the trainer is more surprised."""
    lines = ["| candidate | trainer PPL | engine PPL | log-PPL diff d | mean abs d | min / max d | PPL ratio | "
             "seq chi2 | empty |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['candidate']} | {r['seq_training_ppl']:.4g} | {r['seq_rollout_ppl']:.4g} | "
                     f"{r['seq_log_ppl_diff']:.3g} | {r['seq_log_ppl_abs_diff']:.3g} | "
                     f"{r['seq_log_ppl_diff_min']:.3g} / {r['seq_log_ppl_diff_max']:.3g} | {r['seq_ppl_ratio']:.4g} | "
                     f"{r['seq_chi2']:.3g} | {r['seq_empty_count']:.0f} |")
    return lines
