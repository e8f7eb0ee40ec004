"""The benchmark harness's pure parts (bench/harness.py, bench/profiles.py): summaries, FLOP arithmetic, step
times from metrics rows, ratios, verdicts and the markdown report. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import harness  # noqa: E402
import profiles  # noqa: E402


def test_summarize_median_min_max():
    s = harness.summarize([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError):
        harness.summarize([])


def test_flop_arithmetic():
    assert harness.gemm_flops_per_s(1000, 2.0) == 1e9
    # 230 GFLOP/s over 2 x 135M parameters: about 852 tokens/s
    assert harness.decode_bound_tokens_per_s(230e9, 135_000_000) == pytest.approx(851.85, abs=0.01)
    # 6 N + 12 layers hidden L: 6 * 100 + 12 * 2 * 4 * 8
    assert harness.train_flops_per_token(100, 2, 4, 8) == 600 + 768


def test_step_times_drop_eval_and_the_warm_up_step():
    rows = [{"step": 0, "eval/accuracy": 0.3}, {"step": 1, "time/step": 9.0}, {"step": 2, "time/step": 5.0},
            {"step": 3, "time/step": 7.5, "time/eval": 1.5}]
    assert harness.step_times(rows) == [5.0, 6.0]
    assert harness.step_times(rows[:2]) == [9.0]  # one step: nothing to drop
    assert harness.step_times(rows, skip_first=False) == [9.0, 5.0, 6.0]


def test_ratio_and_verdict():
    a, b = harness.summarize([2.0, 4.0, 3.0]), harness.summarize([6.0, 8.0, 10.0])
    r = harness.ratio(a, b)
    assert r == {"median": 3.0 / 8.0, "min": 2.0 / 10.0, "max": 4.0 / 6.0}
    assert harness.verdict(0.4, 0.5, higher_is_better=False) == "met"
    assert harness.verdict(0.4, 0.5, higher_is_better=True) == "missed"


def test_fmt():
    assert harness.fmt(harness.summarize([1.0, 2.0, 3.0])) == "2.0 (1.0-3.0)"
    assert harness.fmt(harness.summarize([0.01]), 3, scale=0.01) == "1.000"
    assert harness.fmt(None) == "n/a"


def _results() -> dict:
    s = harness.summarize
    return {
        "settings": {"threads": 2, "repeats": 3, "quick": False, "prompts": 4, "group": 8, "new_tokens": 128,
                     "grpo_new_tokens": 64, "lr": 2e-5, "micro_batch": 8, "grpo_steps": 6},
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 8.0, "python": "3.11", "torch": "2.13.0",
                    "transformers": "5", "llama_cpp": "0.3", "trl": "1.16.0", "date": "2026-01-01"},
        "gemm": {"n": 2048, "gflops": s([200.0, 230.0, 240.0])},
        "model": {"name": "m", "parameters": 135_000_000},
        "rollout": {
            "nearpolicy llamacpp:q8_0": {"name": "nearpolicy llamacpp:q8_0", "tokens_per_s": s([400.0, 420.0, 410.0]),
                                         "tokens": s([4000, 4000, 4000]), "logprobs": "yes", "peak_rss_kib": 1024**2,
                                         "profile": {"forward_s": 8.0, "total_s": 10.0, "forward": "llama_decode"}},
            "transformers-generate": {"name": "transformers-generate", "tokens_per_s": s([100.0, 100.0, 100.0]),
                                      "tokens": s([4000, 4000, 4000]), "logprobs": "no"},
        },
        "grpo": {"nearpolicy": {"step_s": s([10.0, 11.0, 12.0]), "diagnostics_fraction": s([0.001, 0.002, 0.003]),
                                "phases": {"rollout": s([4.0, 4.0, 4.0]), "update": s([5.0, 5.0, 5.0])}},
                 "nearpolicy-no-diagnostics": {"step_s": s([10.0, 10.9, 12.0])},
                 "trl": {"step_s": s([40.0, 44.0, 48.0])}},
        "trainer": {"batch": 8, "seq_len": 128, "flops_per_token": 1e9, "tokens_per_s": s([120.0, 125.0, 130.0]),
                    "gflops": s([120.0, 125.0, 130.0]), "profile": [{"op": "aten::mm", "self_ms": 5.0, "share": 0.6}]},
        "failures": [],
    }


def test_derive_and_render():
    res = _results()
    d = harness.derive(res)
    assert d["decode_bound_tokens_per_s"] == pytest.approx(230e9 / 270e6)
    assert res["rollout"]["nearpolicy llamacpp:q8_0"]["vs_generate"]["median"] == pytest.approx(4.1)
    assert d["grpo_step_ratio"]["median"] == pytest.approx(0.25)
    assert d["trainer_vs_gemm_peak"] == pytest.approx(125.0 / 230.0)
    md = harness.render_markdown(res, d, "make bench", profiles.notes(res, d))
    assert "| nearpolicy llamacpp:q8_0 | yes | 410.0 (400.0-420.0) |" in md
    assert "nearpolicy / TRL step time: **0.25** (0.21-0.30)." in md
    assert "| GRPO step <= 0.33 x TRL's | 0.25x | met |" in md
    assert "| trainer forward+backward > 50% of GEMM peak | 54% | met |" in md
    assert "| diagnostics < 2% of step time | 0.200% | met |" in md
    assert "Targets missed in this run: " not in md
    assert "| nearpolicy llamacpp:q8_0 | llama_decode | 80% | 20% |" in md
    assert "make bench" in md and "Test CPU" in md
    assert "Raw numbers: `docs/benchmarks.json`." in md  # the default page's JSON; --out names its own
    assert "Raw numbers: `docs/bench/x.json`." in harness.render_markdown(res, d, "make bench", raw="docs/bench/x.json")


def test_missed_targets_are_named():
    res = _results()
    res["trainer"]["gflops"] = harness.summarize([50.0])
    d = harness.derive(res)
    assert "Targets missed in this run: trainer vs GEMM peak." in profiles.notes(res, d)


def test_the_equal_length_ratio_is_a_target_of_its_own():
    s = lambda m: {"median": m, "min": m, "max": m, "n": 3, "values": [m] * 3}  # noqa: E731
    res = _results()
    res["grpo"] |= {"nearpolicy-equal-length": {"step_s": s(19.5)}, "trl-equal-length": {"step_s": s(44.6)}}
    d = harness.derive(res)
    md = harness.render_markdown(res, d, "make bench", profiles.notes(res, d))
    assert "| GRPO step at equal length <= 0.33 x TRL's | 0.44x | missed |" in md
    assert "Targets missed in this run: GRPO step vs TRL at equal length." in md
    res["grpo"]["nearpolicy-equal-length"]["step_s"] = s(13.0)
    d = harness.derive(res)
    assert "| GRPO step at equal length <= 0.33 x TRL's | 0.29x | met |" in harness.render_markdown(res, d, "make bench")
    assert "Both sides update in bf16" not in harness.render_markdown(res, d, "make bench")
    res["settings"]["trainer_precision"] = "bf16"
    assert "Both sides update in bf16" in harness.render_markdown(res, d, "make bench")


def test_decode_steps_are_bucketed_by_active_sequences():
    steps = {"32": [10, 1.0], "30": [5, 0.4], "3": [20, 0.6], 8: [1, 0.05], 9: [2, 0.1]}
    assert profiles.decode_step_buckets(steps) == [(1, 8, 21, 68, 0.65), (9, 16, 2, 18, 0.1), (25, 32, 15, 470, 1.4)]
    roll = {"nearpolicy llamacpp:q8_0": {"profile": {"decode_steps": steps}}}
    table = "\n".join(profiles._decode_step_profile(roll, bound=470 / 1.4 * 2))
    assert "| nearpolicy llamacpp:q8_0 | 25-32 | 15 | 93 | 336 | 50% |" in table


def test_why_paragraphs_are_computed_from_the_run():
    s = lambda m: {"median": m, "min": m, "max": m, "n": 3}  # noqa: E731
    res = {"rollout": {"nearpolicy llamacpp:f16": {"tokens_per_s": s(150.0), "profile": {
               "forward_s": 9.0, "total_s": 10.0, "decode_steps": {"32": [10, 1.0], "4": [10, 0.5]}}}},
           "grpo": {"nearpolicy": {"step_s": s(40.0), "phases": {"update": s(30.0), "rollout": s(5.0), "sync": s(4.0)}},
                    "trl": {"step_s": s(60.0)}}}
    text = "\n".join(profiles._why(res, {"decode_bound_tokens_per_s": 640.0},
                                   ["rollout vs the decoding compute bound", "GRPO step vs TRL"]))
    assert "90% of nearpolicy llamacpp:f16's rollout time" in text
    assert "the mean decode call carried 18.0 sequences" in text  # (320 + 40) tokens / 20 calls
    assert "calls with 25-32 sequences ran at 320 tokens/s (50% of the bound)" in text
    assert "calls with 1-8 at 80 tokens/s (12%)" in text
    assert "takes 30.0 s of nearpolicy's 40.0 s step; the 0.33x target allows 19.8 s in all" in text
    assert "(0.50x TRL's 60.0 s for the update alone), so 20.2 s would have to go" in text
    assert "Rollout plus weight sync take 9.0 s, against about 30.0 s" in text
    assert profiles._why(res, {"decode_bound_tokens_per_s": 640.0}, []) == []
    assert "llama.cpp's decode call" in text and "AVX2 kernels" in text
    res["rollout"] = {"nearpolicy hf:bf16": res["rollout"]["nearpolicy llamacpp:f16"]}
    text = "\n".join(profiles._why(res, {"decode_bound_tokens_per_s": 640.0}, ["rollout vs the decoding compute bound"]))
    assert "inside the hf engine's prefill and decode steps" in text and "llama.cpp" not in text
    assert "calls with 25-32 sequences ran at 320 tokens/s (50% of the bound)" in text and "memory bandwidth" in text


def test_the_hf_bf16_arm_gets_its_own_ratio_line_and_not_the_target():
    res = _results()
    res["grpo"]["nearpolicy-hf-bf16"] = {"step_s": harness.summarize([8.0, 8.8, 9.6])}
    d = harness.derive(res)
    assert d["grpo_step_ratio_hf_bf16"]["median"] == pytest.approx(0.2)
    md = harness.render_markdown(res, d, "make bench", profiles.notes(res, d))
    assert "With the in-process bf16 engine" in md and ": 0.20 (0.17-0.24)." in md
    assert "| GRPO step <= 0.33 x TRL's | 0.25x | met |" in md  # the target stays the main job's engine


def test_length_stats_quantiles_and_seconds_per_trained_token():
    # linear interpolation (numpy's default): p50 of 10 values sits between the 5th and 6th, p90 at 0.1 of 9th->10th
    lengths = [3, 64, 10, 20, 64, 7, 30, 12, 64, 8]
    st = harness.length_stats(lengths, [n == 64 for n in lengths])
    assert st == {"response_tokens": 28.2, "response_p50": 16.0, "response_p90": 64.0, "truncated_share": 0.3,
                  "trained_tokens": 282.0}
    assert harness.quantile([1, 2, 3, 4], 0.9) == pytest.approx(3.7) and harness.quantile([5], 0.5) == 5.0
    with pytest.raises(ValueError):
        harness.length_stats([1, 2], [False])
    # 2 steps of 10 s and 14 s over 800 + 400 trained tokens: 24 s / 1.2k tokens
    assert harness.seconds_per_1k_tokens([10.0, 14.0], [800.0, 400.0]) == pytest.approx(20.0)


def test_length_gap_intervals_take_prompts_as_the_unit():
    import length_gap

    # per-prompt means 2 and 6: mean 4, sd 2 sqrt 2, half-width t_{0.975, 1} x 2 sqrt 2 / sqrt 2 = 12.7062 x 2
    r = length_gap.mean_ci([[1, 3], [5, 7]])
    assert r["mean"] == 4.0 and r["ci95"] == pytest.approx(2 * 12.7062, rel=1e-4)
    # paired: per-prompt differences 1 and 3 (the samples' order within a prompt does not matter)
    d = length_gap.paired_difference([[2, 4], [9, 9]], [[2, 2], [5, 7]])
    assert d["mean"] == 2.0 and d["ci95"] == pytest.approx(12.7062, rel=1e-4)
    s = length_gap.summary([[3, 64], [10, 20]], [[False, True], [False, False]])
    assert (s["mean"], s["p50"], s["truncated_share"], s["n"]) == (24.25, 15.0, 0.25, 4)
    with pytest.raises(ValueError):
        length_gap.mean_ci([[1, 2]])


def test_per_token_and_equal_length_ratios_are_derived_and_shown():
    res = _results()
    s = harness.summarize
    res["grpo"]["nearpolicy"] |= {"s_per_1k_tokens": s([11.0, 12.0, 13.0]),
                                  "batch": {"response_tokens": s([28.0]), "response_p50": s([24.0]),
                                            "response_p90": s([64.0]), "truncated_share": s([0.25])}}
    res["grpo"]["trl"]["s_per_1k_tokens"] = s([22.0, 24.0, 26.0])
    res["grpo"]["nearpolicy-equal-length"] = {"step_s": s([15.0, 16.0, 17.0])}
    res["grpo"]["trl-equal-length"] = {"step_s": s([50.0, 52.0, 54.0])}
    d = harness.derive(res)
    assert d["grpo_token_ratio"]["median"] == pytest.approx(0.5)
    assert d["grpo_step_ratio_equal_length"] == pytest.approx({"median": 16 / 52, "min": 15 / 54, "max": 17 / 50})
    md = harness.render_markdown(res, d, "make bench", profiles.notes(res, d))
    assert "| 28.0 | 24 / 64 | 0.25 | 12.00 (11.00-13.00) |" in md
    assert "Per trained token (s / 1k trained tokens, nearpolicy / TRL): 0.50 (0.42-0.59)." in md
    assert "Equal length (nearpolicy-equal-length / trl-equal-length" in md and "step): 0.31 (0.28-0.34)." in md
    assert "| GRPO step <= 0.33 x TRL's | 0.25x | met |" in md  # the target stays the natural-length ratio


def test_runs_table_keeps_each_k3_third_in_its_column(tmp_path):
    """A run two steps in: its first third holds no step, shown as '-', so the later thirds stay in their columns
    (they moved left, the second third read as the first)."""
    import json

    import runs_table

    rows = [{"step": 0, "eval/accuracy": 0.3}] + [
        {"step": s, "mismatch/k3": 0.1 * s, "mismatch/ess": 0.9, "entropy": 1.0, "time/step": 2.0, "time/update": 1.0,
         "time/sync": 0.5} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = runs_table.summarize(tmp_path)
    assert summary["k3_thirds"] == [None, 0.1, 0.2] and summary["k3_last"] == 0.2
    assert "| - / 0.1 / 0.2 | 0.2 |" in runs_table.markdown([summary])


def test_a_regenerated_page_keeps_the_sections_measured_apart(tmp_path):
    """Issue 38 item 12: `make bench` rewrote docs/benchmarks.md and the aligned trainer's cost (1.47x / 1.61x),
    which docs/aligned.md and the README cite, was gone. The sections measured apart from the harness live in
    docs/bench/ and are appended at every render: re-rendering the committed page from its JSON keeps them."""
    import shutil
    import subprocess

    import run_all

    root = Path(__file__).resolve().parent.parent
    for name in run_all.KEPT_SECTIONS:
        (tmp_path / name).write_text(f"## {name}\n")
    assert run_all.kept_sections(tmp_path) == "\n\n## vllm_rollouts.md\n\n\n## aligned_cost.md\n"
    assert run_all.kept_sections(tmp_path / "none") == ""
    shutil.copy(root / "docs/benchmarks.json", tmp_path / "benchmarks.json")
    subprocess.run([sys.executable, str(root / "bench/run_all.py"), "--render", str(tmp_path / "benchmarks.json")],
                   check=True, capture_output=True)
    regenerated, committed = (tmp_path / "benchmarks.md").read_text(), (root / "docs/benchmarks.md").read_text()
    for page in (regenerated, committed):
        assert "| aligned to q8_0 | 7.79 | 1.47x |" in page
        assert "| aligned to q4_1 (embeddings q8_0) | 8.58 | 1.61x |" in page
        for name in run_all.KEPT_SECTIONS:
            assert (root / "docs/bench" / name).read_text() in page
    for citing in ("docs/aligned.md", "README.md"):
        assert "1.47x" in (root / citing).read_text() and "1.61x" in (root / citing).read_text()


def test_the_arena_figures_file_is_what_the_script_prints_from_the_committed_cells():
    """Issue 38 item 11: docs/arena.md's trainer-wait and per-cell minute ranges did not match the cells' data.
    The figures its prose cites are printed by bench/arena_figures.py from docs/arena-runs/*.tar.gz, and the committed
    output beside the tarballs is that output (rerun the script after changing either)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    printed = subprocess.run([sys.executable, str(root / "bench/arena_figures.py")], check=True, capture_output=True,
                             text=True).stdout
    assert printed == (root / "docs/arena-runs/figures.txt").read_text()
    assert "trainer wait at step 1 17-39 s, then 34-99 s at 12 steps" in printed  # eta = 4 (the page said 54-63 s)
    assert "arena-mc-grpo: machine time 7021 s (1.95 h); 18 of 18 cells done, 4.2-10.3 min each" in printed


def test_the_dose_recovery_file_is_what_the_script_prints_from_the_committed_cells():
    """docs/arena.md's "about half the loss recovered" figures come from bench/dose_recovery.py over the committed
    tarballs; the committed output must be what the script prints now."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    printed = subprocess.run([sys.executable, str(root / "bench/dose_recovery.py")], check=True, capture_output=True,
                             text=True).stdout
    assert printed == (root / "docs/arena-runs/dose-recovery.txt").read_text()


def test_the_lora_table_is_what_the_script_prints_from_the_committed_cells():
    """docs/results.md sec. 16's table (docs/bench/lora-table.md) is bench/lora_table.py's output on the committed
    LoRA arena package (rerun the script after changing either)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    printed = subprocess.run([sys.executable, str(root / "bench/lora_table.py"),
                              str(root / "docs/arena-runs/arena-lora.tar.gz")], check=True, capture_output=True,
                             text=True).stdout
    committed = (root / "docs/bench/lora-table.md").read_text()
    assert printed == committed
    assert committed in (root / "docs/results.md").read_text()


@pytest.mark.parametrize("script,args,committed", [
    ("mixture_table.py", ["arena-runs/arena-mixture.tar.gz"], "mixture-table.md"),
    ("paired_cells.py", ["arena-runs/arena-mixture.tar.gz", "adaptive/q8_0:fixed/q8_0"], "mixture-paired.md"),
    ("paired_cells.py", ["arena-runs/arena-methods.tar.gz", "popo/q8_0:full/q8_0", "xrpo/q8_0:full/q8_0",
                         "mipu/q8_0:full/q8_0", "reward_variance/q8_0:full/q8_0", "mipu/q4_1:full/q4_1"],
     "methods-paired.md"),
    ("paired_cells.py", ["arena-runs/arena-distill.tar.gz", "forward/q8_0:reverse/q8_0", "ropd/q8_0:forward/q8_0",
                         "ropd/q8_0:reverse/q8_0"], "distill-paired.md"),
    ("paired_cells.py", ["arena-runs/arena-mc-grpo-power.tar.gz", "mc_grpo_g1/G8:mc_grpo_g1/G2", "grpo/G8:grpo/G2",
                         "mc_grpo_g1/G2:grpo/G2", "mc_grpo_g1/G8:grpo/G8"], "mc-grpo-power-paired.md"),
    ("paired_cells.py", ["arena-runs/arena-staleness-mb4.tar.gz", "decoupled/eta4:bypass/eta4"],
     "staleness-mb4-paired.md"),
    ("paired_cells.py", ["arena-runs/arena-mc-grpo-128.tar.gz", "mc_grpo_g1/G8:mc_grpo_g1/G2"], "mc-grpo-128-paired.md"),
    ("main_precision_table.py", ["runs/main-precision-2026-12-07.tar.gz"], "main-precision-table.md"),
    ("paired_cells.py", ["runs/main-precision-2026-12-07.tar.gz", "bf16/q8_0:fp32/q8_0"], "main-precision-paired.md"),
    ("main_precision_table.py", ["runs/main-onepass-2026-12-07.tar.gz"], "main-onepass-table.md"),
    ("main_precision_table.py", ["runs/main-max32-2026-12-07.tar.gz"], "main-max32-table.md"),
    ("main_job_floor.py", ["runs/main-precision-2026-12-07.tar.gz", "docs/runs/main-onepass-2026-12-07.tar.gz"],
     "main-job-floor.md"),
])
def test_the_seed_method_tables_are_what_the_scripts_print_from_the_committed_cells(script, args, committed):
    """docs/results.md secs. 1, 5 (the main job's floor) and 17-19's tables and the problems x seeds column of docs/arena.md's MC-GRPO power
    arena (docs/bench/*.md) are the scripts' output on the committed packages."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    printed = subprocess.run([sys.executable, str(root / "bench" / script), str(root / "docs" / args[0]),
                              *args[1:]], check=True, capture_output=True, text=True, cwd=root).stdout
    assert printed == (root / "docs/bench" / committed).read_text()
