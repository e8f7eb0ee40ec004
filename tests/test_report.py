"""`nearpolicy report` / `compare`: panels drawn or marked missing, valid PNGs, header values, error paths, and the
main job's report opened in headless Chromium (Debian's /usr/bin/chromium, driven by playwright) with every image
loaded."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
from PIL import Image

from nearpolicy.cli import main
from nearpolicy.runs.report import PANELS, Panel, Run, legend_name, load_run, panel_figure, render_panel, run_summary

MAIN_JOB_METRICS = Path(__file__).parents[1] / "docs" / "runs" / "grpo-smollm2-chain-sum.metrics.jsonl"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
FAKE_K3 = [0.0, 0.004, 0.002]  # a zero k3 cannot be drawn on the log scale and is left out


def _fake_rows() -> list[dict]:
    """A 3-step run: eval at steps 0 and 3, no policy-lag or staleness metrics, one non-finite (null) entropy."""
    rows = [{"step": 0, "eval/accuracy": 0.25, "eval/response_length": 11.0}]
    for step, k3 in enumerate(FAKE_K3, 1):
        rows.append({"step": step, "reward/mean": 0.1 * step, "reward/std": 0.3, "mismatch/k3": k3,
                     "mismatch/ess": 0.99, "actor/pg_clipfrac": 0.01, "correction/frac_high": 0.0,
                     "mismatch/frac_ratio_outside_0.5_2": 0.0, "time/rollout": 2.0, "time/update": 3.0,
                     "time/step": 6.0, "throughput/rollout_tokens_per_s": 100.0 + step,
                     "entropy": None if step == 2 else 1.5, "response/length_mean": 30.0,
                     "mismatch/seq_log_ppl_diff": 0.01 * step, "mismatch/seq_log_ppl_abs_diff": 0.02 * step,
                     "mismatch/seq_log_ppl_diff_min": -0.03, "mismatch/seq_log_ppl_diff_max": 0.05})
    rows[-1] |= {"eval/accuracy": 0.5, "time/eval": 1.0}
    return rows


def _write_run(folder: Path, rows: list[dict], config: dict | None = None, plan: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, data in (("config.json", config), ("plan.json", plan)):
        if data is not None:
            (folder / name).write_text(json.dumps(data))
    return folder


def _sections(page: str) -> dict[str, str]:
    """Panel title -> the HTML of its section."""
    return dict(re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", page))


def _images(page: str) -> list[Image.Image]:
    """Every data-URI image of the page, decoded and verified as PNG."""
    images = []
    for data in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page):
        raw = base64.b64decode(data)
        assert raw.startswith(b"\x89PNG\r\n\x1a\n")
        Image.open(io.BytesIO(raw)).verify()
        images.append(Image.open(io.BytesIO(raw)))
    return images


@pytest.fixture
def fake_run(tmp_path: Path) -> Path:
    return _write_run(tmp_path / "fake", _fake_rows(), config={"model": {"path": "smollm2"}, "run": {"steps": 3}},
                      plan={"engine": "llamacpp:q8_0"})


@pytest.fixture
def main_job_run(tmp_path: Path) -> Path:
    """A run folder holding only the main job's metrics.jsonl (no config.json, no plan.json)."""
    folder = tmp_path / "grpo-smollm2-chain-sum"
    folder.mkdir()
    shutil.copy(MAIN_JOB_METRICS, folder / "metrics.jsonl")
    return folder


def test_fake_run_draws_recorded_panels_and_names_missing_ones(fake_run: Path):
    assert main(["report", str(fake_run)]) == 0
    page = (fake_run / "report.html").read_text()
    sections = _sections(page)
    assert list(sections) == [panel.title for panel in PANELS] + ["Eval samples"]
    assert sections["Eval samples"] == "<p class='note'>not recorded in this run (samples.jsonl)</p>"
    drawn = {title for title, body in sections.items() if "data:image/png" in body}
    assert drawn == {panel.title for panel in PANELS} - {"Staleness"}
    assert "not recorded in this run (a synchronous run" in sections["Staleness"]
    assert "policy lag (mismatch/lag_k3): not recorded in this run" in sections["Mismatch k3 by component (log scale)"]
    assert "mismatch/frac_ratio_outside_0.5_2" not in page  # a mismatch metric, not a clip or mask fraction
    images = _images(page)
    assert len(images) == len(drawn)
    assert all(image.width == 800 and image.height == 340 for image in images)
    for cell in ("<th>fake</th>", "<td>smollm2</td>", "<td>llamacpp:q8_0</td>", "<td>3 of 3</td>",
                 "<td>0.500 (step 3)</td>", "<td>0.002 nats</td>", "<td>0.3 min</td>"):
        assert cell in page


def test_fraction_panel_matches_clip_and_mask_fractions_only():
    fractions = next(panel for panel in PANELS if panel.title == "Clip and mask fractions")
    run = Run("r", [{"step": 1, "actor/pg_clipfrac": 0.0, "correction/frac_low": 0.0, "correction/mask_frac": 0.0,
                     "seq/clip_frac": 0.0, "actor/loss": 1.0, "mismatch/frac_ratio_outside_0.5_2": 0.0}])
    assert [key for _, key in fractions.lines(run)] == ["actor/pg_clipfrac", "correction/frac_low",
                                                         "correction/mask_frac", "seq/clip_frac"]


@pytest.mark.parametrize("title, key, value", [("Mismatch k3 by component (log scale)", "mismatch/k3", 0.0),
                                               ("Entropy", "entropy", None)])
def test_panel_without_drawable_values_is_still_an_image(title: str, key: str, value):
    panel = next(panel for panel in PANELS if panel.title == title)
    png = render_panel(panel, [Run("r", [{"step": s, key: value} for s in (1, 2)])])
    assert Image.open(io.BytesIO(png)).size == (800, 340)


def test_log_perplexity_panel_draws_the_four_per_sequence_lines():
    panel = next(panel for panel in PANELS if panel.title == "Log-perplexity difference per sequence")
    run = Run("r", _fake_rows())
    assert [(series.label, key) for series, key in panel.lines(run)] == [
        ("mean", "mismatch/seq_log_ppl_diff"), ("mean |d|", "mismatch/seq_log_ppl_abs_diff"),
        ("min", "mismatch/seq_log_ppl_diff_min"), ("max", "mismatch/seq_log_ppl_diff_max")]
    steps, values = run.series("mismatch/seq_log_ppl_diff")
    assert steps == [1, 2, 3] and values == pytest.approx([0.01, 0.02, 0.03], abs=1e-15)
    assert len(panel_figure(panel, [run]).axes[0].lines) == 4


def test_lag_components_and_staleness_are_drawn_when_recorded(tmp_path: Path):
    rows = [{"step": s, "mismatch/k3": 1.0, "mismatch/discrepancy_k3": 0.001 * s, "mismatch/lag_k3": 0.01,
             "mismatch/total_k3": 0.011, "mismatch/discrepancy_ess": 0.99, "mismatch/lag_ess": 0.9,
             "mismatch/fresh_k3": 0.001, "mismatch/stale_k3": 0.02,
             "staleness/mean": 0.5, "staleness/max": 1.0} for s in (1, 2, 3)]
    run = load_run(_write_run(tmp_path / "async", rows))
    mismatch: Panel = PANELS[2]
    assert [(series.label, key) for series, key in mismatch.lines(run)] == [
        ("numerical discrepancy", "mismatch/discrepancy_k3"), ("policy lag", "mismatch/lag_k3"),
        ("total", "mismatch/total_k3"), ("current-version tokens (async)", "mismatch/fresh_k3"),
        ("older-version tokens (async)", "mismatch/stale_k3")]
    assert run_summary(run)["median k3 (discrepancy)"] == "0.002 nats"  # discrepancy_k3, not the older k3
    assert main(["report", str(tmp_path / "async")]) == 0
    sections = _sections((tmp_path / "async" / "report.html").read_text())
    assert "not recorded" not in sections["Mismatch k3 by component (log scale)"]
    assert "not recorded" not in sections["Effective sample size"]
    assert "data:image/png" in sections["Staleness"]
    assert "off-policy token fraction (staleness/off_policy_token_frac): not recorded" in sections["Staleness"]


def test_main_job_report_from_metrics_alone(main_job_run: Path):
    rows = [json.loads(line) for line in MAIN_JOB_METRICS.read_text().splitlines()]
    assert main(["report", str(main_job_run), "-o", str(main_job_run / "out.html")]) == 0
    page = (main_job_run / "out.html").read_text()
    median_k3 = statistics.median(row["mismatch/k3"] for row in rows if "mismatch/k3" in row)
    for cell in ("<td>unknown (no config.json)</td>", "<td>not recorded</td>", "<td>30</td>",
                 "<td>0.492 (step 30)</td>", "<td>0.695 (step 20)</td>", f"<td>{median_k3:.3g} nats</td>"):
        assert cell in page
    assert len(_images(page)) == len(PANELS) - 2  # all but staleness and the per-sequence panel (not logged then)
    assert "not recorded in this run (a run older than these metrics" in _sections(page)["Log-perplexity difference per sequence"]


def test_compare_overlays_runs_and_names_what_one_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    first = _write_run(tmp_path / "a" / "run-a", _fake_rows())
    second = _write_run(tmp_path / "b" / "run-b", [{k: v for k, v in row.items() if k != "entropy"}
                                                   for row in _fake_rows()])
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(first), str(second)]) == 0
    page = (tmp_path / "runs" / "compare.html").read_text()  # the default output
    assert "<h1>nearpolicy compare: run-a, run-b</h1>" in page
    assert "<th>run-a</th>" in page and "<th>run-b</th>" in page
    assert "entropy (entropy): not recorded in run-b" in _sections(page)["Entropy"]
    assert len(_images(page)) == len(PANELS) - 1


def test_compare_labels_same_named_folders_by_path(tmp_path: Path):
    first = _write_run(tmp_path / "a" / "run", _fake_rows())
    second = _write_run(tmp_path / "b" / "run", _fake_rows())
    assert main(["compare", str(first), str(second), "-o", str(tmp_path / "out.html")]) == 0
    page = (tmp_path / "out.html").read_text()
    assert f"<th>{first}</th>" in page and f"<th>{second}</th>" in page


def test_cut_short_last_line_is_skipped_with_a_warning(fake_run: Path, capsys: pytest.CaptureFixture):
    with (fake_run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward/me')
    assert main(["report", str(fake_run)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {fake_run / 'metrics.jsonl'}: skipped line 5, cut short" in err
    assert "skipped line 5" in (fake_run / "report.html").read_text()


@pytest.mark.parametrize("damage, message", [
    (lambda run: shutil.rmtree(run), "run folder {run} does not exist"),
    (lambda run: (run / "metrics.jsonl").unlink(), "no metrics.jsonl in {run}"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n'),
     "{run}/metrics.jsonl line 2 is not valid JSON"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n'),
     "{run}/metrics.jsonl line 2 is not a metrics object with an integer 'step'"),
    (lambda run: (run / "metrics.jsonl").write_text("\n"), "{run}/metrics.jsonl holds no metric rows"),
    (lambda run: (run / "config.json").write_text("{"), "{run}/config.json is not valid JSON"),
    (lambda run: (run / "plan.json").write_text("[]"), "{run}/plan.json does not hold a JSON object"),
], ids=["no-folder", "no-metrics", "bad-line", "not-an-object", "empty", "bad-config", "plan-not-object"])
def test_unreadable_run_exits_2_naming_the_file(fake_run: Path, capsys: pytest.CaptureFixture, damage, message):
    damage(fake_run)
    assert main(["report", str(fake_run)]) == 2
    assert f"error: {message.format(run=fake_run)}" in capsys.readouterr().err
    assert not (fake_run / "report.html").exists()


def test_unwritable_output_exits_2(fake_run: Path, capsys: pytest.CaptureFixture):
    out = fake_run / "metrics.jsonl" / "report.html"  # under a file: no folder can be made
    assert main(["report", str(fake_run), "-o", str(out)]) == 2
    assert f"error: cannot write {out}" in capsys.readouterr().err


def test_report_opens_in_headless_chromium_with_every_image_loaded(main_job_run: Path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); make test does")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[test]'")
    assert main(["report", str(main_job_run)]) == 0
    page_file = main_job_run / "report.html"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 800})
            page.goto(page_file.as_uri(), wait_until="load")
            loaded = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete && i.naturalWidth > 0)")
            page_width = page.evaluate("document.documentElement.scrollWidth")
            screenshot = page.screenshot(full_page=True)
        finally:
            browser.close()
    assert loaded == [True] * (len(PANELS) - 2)  # the main job's metrics predate the per-sequence panel
    image = Image.open(io.BytesIO(screenshot))
    assert page_width <= 1400  # nothing wider than the window
    assert image.format == "PNG" and image.width == 1400 and image.height > 800
    low, high = image.convert("L").getextrema()
    assert low < high


def test_summary_report_and_compare_show_each_runs_effective_correction(tmp_path: Path, capsys: pytest.CaptureFixture):
    icepop, tis = "icepop: token mask [0.5, 5], decoupled", "tis: token truncate [0, 2], decoupled"
    first = _write_run(tmp_path / "run-a", _fake_rows(), plan={"engine": "llamacpp:q8_0", "correction_effective": icepop})
    second = _write_run(tmp_path / "run-b", _fake_rows(), plan={"engine": "llamacpp:q8_0", "correction_effective": tis})
    assert main(["summary", str(first)]) == 0
    assert f"- correction: {icepop}\n" in capsys.readouterr().out
    assert main(["report", str(first), "-o", str(tmp_path / "one.html")]) == 0
    assert f"<td>{icepop}</td>" in (tmp_path / "one.html").read_text()
    assert main(["compare", str(first), str(second), "-o", str(tmp_path / "two.html")]) == 0
    page = (tmp_path / "two.html").read_text()
    assert "<th>correction</th>" in page and f"<td>{icepop}</td>" in page and f"<td>{tis}</td>" in page


def test_summary_report_and_compare_say_what_each_run_is(tmp_path: Path, capsys: pytest.CaptureFixture):
    config = {"algorithm": {"advantage": "grpo", "loss": "ppo_clip", "aggregation": "token-mean",
                            "kl_estimator": "k3_is", "kl_coef": 0.01}, "correction": {"proximal": "ewma"}}
    rows = _fake_rows()
    rows[2] |= {"correction/frac_low": 0.125, "correction/rejected_frac": 0.25}
    plan = {"engine": "llamacpp:q4_1", "correction_effective": "icepop: token mask [0.5, 5], decoupled"}
    first = _write_run(tmp_path / "run-a", rows, config=config, plan=plan)
    second = _write_run(tmp_path / "run-b", _fake_rows(), plan={"engine": "hf:fp32", "correction_effective": "off: x"})
    assert main(["summary", str(first)]) == 0
    out = capsys.readouterr().out
    for line in ("- model: not recorded\n", "- task: not recorded\n", "- engine: llamacpp:q4_1\n", "- update: grpo / ppo_clip / token-mean\n", "- KL: k3_is x 0.01\n",
                 "- proximal: ewma\n", "| correction/frac_low | 0.125 | 0.125 | 0.125 | 0.125 |\n",
                 "| correction/rejected_frac | 0.25 | 0.25 | 0.25 | 0.25 |\n"):
        assert line in out
    assert main(["report", str(first), "-o", str(tmp_path / "one.html")]) == 0
    page = (tmp_path / "one.html").read_text()
    assert "<th>KL</th>" in page and "<td>k3_is x 0.01</td>" in page and "<td>llamacpp:q4_1</td>" in page
    runs = [load_run(first), load_run(second)]
    assert [legend_name(run) for run in runs] == ["run-a (llamacpp:q4_1, icepop)", "run-b (hf:fp32, off)"]
    fig = panel_figure(PANELS[1], runs)  # eval accuracy: one line per run
    assert fig.legends[0].get_texts()[0].get_text() == "run-a (llamacpp:q4_1, icepop)"
    from nearpolicy.runs.summary import describe_run

    bf16 = {"algorithm": config["algorithm"] | {"trainer_precision": "bf16"}}
    assert describe_run(bf16, plan)["update"] == "grpo / ppo_clip / token-mean, trainer in bf16"
    assert describe_run({"algorithm": config["algorithm"] | {"trainer_precision": "fp32"}}, plan)["update"] == \
        "grpo / ppo_clip / token-mean"


def test_summary_and_report_name_the_learning_rate_schedule(tmp_path: Path, capsys: pytest.CaptureFixture):
    cosine = {"algorithm": {"lr": 1.5e-5, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}}
    first = _write_run(tmp_path / "run-a", _fake_rows(), config=cosine)
    second = _write_run(tmp_path / "run-b", _fake_rows(), config={"algorithm": {"lr": 2e-5}})
    assert main(["summary", str(first)]) == 0
    assert "- learning rate: 1.5e-05, cosine to 1.5e-06 after 2 warmup steps\n" in capsys.readouterr().out
    assert main(["summary", str(second)]) == 0  # a config.json from before the schedule keys: constant
    assert "- learning rate: 2e-05, constant\n" in capsys.readouterr().out
    assert main(["report", str(first), "-o", str(tmp_path / "one.html")]) == 0
    page = (tmp_path / "one.html").read_text()
    assert "<th>learning rate</th>" in page and "<td>1.5e-05, cosine to 1.5e-06 after 2 warmup steps</td>" in page


def test_summary_says_a_stopped_run_did_fewer_steps_than_planned(tmp_path: Path, capsys: pytest.CaptureFixture):
    rows = _fake_rows()
    trained = sum("reward/mean" in row for row in rows)
    stopped = _write_run(tmp_path / "stopped", rows, config={"run": {"steps": trained + 25}})
    finished = _write_run(tmp_path / "finished", rows, config={"run": {"steps": trained}})
    assert main(["summary", str(stopped)]) == 0
    assert f"`stopped`: {trained} of {trained + 25} training steps" in capsys.readouterr().out
    assert main(["summary", str(finished)]) == 0
    assert f"`finished`: {trained} training steps" in capsys.readouterr().out


@pytest.mark.parametrize("algorithm,line", [
    ({"lr": "1e-5", "lr_schedule": "cosine"}, "1e-5, cosine"),  # hand-edited: printed as written, no floor
    ({"lr": None}, "not recorded"),
    ({"lr": [1]}, "[1], constant"),
    ({"lr": 1e-5, "lr_schedule": "cosine", "min_lr_ratio": "0.1"}, "1e-05, cosine"),
    ({"lr": 1e-5, "lr_schedule": None}, "1e-05, constant"),
    ({"lr": 1e-5, "kl_estimator": "k3", "kl_coef": "0.1"}, "1e-05, constant"),
])
def test_summary_and_report_survive_a_hand_edited_config(tmp_path: Path, capsys: pytest.CaptureFixture, algorithm, line):
    run = _write_run(tmp_path / "run", _fake_rows(), config={"algorithm": algorithm})
    assert main(["summary", str(run)]) == 0
    assert f"- learning rate: {line}\n" in capsys.readouterr().out
    assert main(["report", str(run), "-o", str(tmp_path / "one.html")]) == 0


def test_plots_have_whole_step_ticks_bands_inside_the_reward_range_and_legends_off_the_lines(tmp_path: Path):
    rows = _fake_rows()
    for row in rows[1:]:
        row |= {"reward/mean": 0.9, "reward/std": 0.4}  # mean +- std runs past 1
    run = load_run(_write_run(tmp_path / "r", rows))
    fig = panel_figure(PANELS[0], [run])
    fig.canvas.draw()
    ax = fig.axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert band.max() == pytest.approx(1.0) and band.min() == pytest.approx(0.5)
    legend, axes_box = fig.legends[0].get_window_extent(), ax.get_window_extent()
    assert legend.y1 <= axes_box.y0  # below the plotting area


def test_summary_and_report_skip_metric_values_that_are_not_numbers(tmp_path: Path, capsys: pytest.CaptureFixture):
    rows = _fake_rows()
    rows[1] |= {"reward/mean": "0.5", "time/step": "fast"}  # hand-edited or foreign rows
    rows[3] |= {"eval/accuracy": True}
    run = _write_run(tmp_path / "odd", rows)
    assert main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| reward/mean | 0.2 | 0.25 | 0.25 | 0.3 |" in out  # steps 2 and 3 only
    eval_table = out.split("| step | eval accuracy (greedy, held-out) |\n|---|---|\n")[1].split("\n\n")[0]
    assert eval_table == "| 0 | 0.250 |"  # step 3's `true` is no accuracy
    assert "Training time (sum of step times, evals included): 0.2 min." in out
    assert main(["report", str(run), "-o", str(tmp_path / "odd.html")]) == 0
    rows[0] |= {"time/eval": 60.0}  # the step-0 eval, before any step
    assert main(["summary", str(_write_run(tmp_path / "timed", rows))]) == 0
    assert "Training time (sum of step times, evals included): 1.2 min." in capsys.readouterr().out
    assert main(["report", str(tmp_path / "timed"), "-o", str(tmp_path / "timed.html")]) == 0  # the same figure
    assert "training time (sum of step times, evals included)</th><td>1.2 min" in (tmp_path / "timed.html").read_text()


def test_summary_lists_the_per_sequence_mismatch_family(tmp_path: Path, capsys: pytest.CaptureFixture):
    """New-user finding: `summary` left out the mismatch/seq_* metrics the report plots. Steps log d = 0.01, 0.02, 0.03:
    its row gives min 0.01, median 0.02, mean 0.02, max 0.03."""
    run = _write_run(tmp_path / "run", _fake_rows())
    assert main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| mismatch/seq_log_ppl_diff | 0.01 | 0.02 | 0.02 | 0.03 |" in out
    assert "| mismatch/seq_log_ppl_abs_diff | 0.02 | 0.04 | 0.04 | 0.06 |" in out


def test_a_stopped_runs_last_eval_says_the_later_steps_had_none(tmp_path: Path):
    rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1}, {"step": 2, "eval/accuracy": 0.5}, {"step": 3}]
    summary = run_summary(load_run(_write_run(tmp_path / "stopped", rows)))
    assert summary["final eval accuracy"] == "0.500 (step 2); step 3 has no eval accuracy"
    rows += [{"step": 4}]
    assert run_summary(load_run(_write_run(tmp_path / "s4", rows)))["final eval accuracy"] == (
        "0.500 (step 2); steps 3-4 have no eval accuracy")
    assert summary["peak eval accuracy"] == "0.500 (step 2)"
    finished = run_summary(load_run(_write_run(tmp_path / "done", rows[:3])))
    assert finished["final eval accuracy"] == "0.500 (step 2)"


def test_a_panel_with_every_point_at_one_step_spans_a_step_either_side():
    fig = panel_figure(PANELS[1], [Run("one-eval", [{"step": 0, "eval/accuracy": 0.25}, {"step": 1}])])
    assert fig.axes[0].get_xlim() == (-1.0, 1.0)
    fig = panel_figure(PANELS[1], [Run("two", [{"step": 0, "eval/accuracy": 0.25}, {"step": 4, "eval/accuracy": 0.5}])])
    low, high = fig.axes[0].get_xlim()
    assert -1 < low < 0 and 4 < high < 5  # matplotlib's own margins when the points span steps
