"""Experiment trackers: a run with logging.wandb = true (offline) writes a wandb run whose history holds the
metrics.jsonl scalars; the progress bar keeps the latest eval accuracy."""

from __future__ import annotations

import json

import pytest

from nearpolicy.config.schema import load_config
from nearpolicy.training.phases import accuracy_figure, progress_postfix
from nearpolicy.runs.folder import finite_scalars
from nearpolicy.runs.trackers import TrackerError, WandbTracker


def _tiny_run(model_dir, out, *sets):
    from nearpolicy.training.trainer import open_trainer

    cfg = load_config(None, [f"model.path='{model_dir}'", f"run.output_dir='{out}'", "run.name=tracked", "run.steps=2",
                             "run.threads=1", "algorithm.prompts_per_step=1", "algorithm.group_size=2",
                             "algorithm.micro_batch_size=2", "sampling.max_new_tokens=4", "task.eval_size=2",
                             "task.train_size=20", "logging.eval_every=1", "logging.checkpoint_every=100",
                             "logging.progress=false", "model.max_context=256", "engine.kind=hf", *sets])
    trainer = open_trainer(cfg, log=lambda _: None)
    try:
        return trainer.fit(progress=False)
    finally:
        trainer.close()


def test_offline_wandb_run_records_the_metrics(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _tiny_run(tiny_model_dir, tmp_path, "logging.wandb=true", "logging.tensorboard=true")
    runs = list((run_dir / "wandb").glob("offline-run-*-tracked"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    record = (runs[0] / "run-tracked.wandb").read_bytes()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    # the wandb record is protobuf: each history item holds the metric's key and its value as JSON text
    for key in ("eval/accuracy", "reward/mean", "mismatch/k3", "time/step"):
        assert key.encode() in record, key
    assert json.dumps(rows[2]["time/step"]).encode() in record
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_failure_is_a_tracker_error(tmp_path, monkeypatch):
    import wandb

    def refuse(**_):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(TrackerError, match=r"wandb could not start \(online mode\): api_key not configured"):
        WandbTracker(tmp_path, "p", "online", {})


def test_trackers_get_only_finite_numbers():
    assert finite_scalars({"a": 1.0, "b": float("nan"), "c": float("inf"), "d": 2, "e": True}) == {"a": 1.0, "d": 2.0}


def test_progress_keeps_the_latest_eval_accuracy():
    after_eval = progress_postfix({"reward/mean": 0.5, "mismatch/k3": 1e-3, "eval/accuracy": 0.25})
    assert after_eval == {"reward": "0.50", "k3": "1.0e-03", "acc": "0.25"}
    later = progress_postfix({"reward/mean": 0.75}, after_eval)
    assert later == {"reward": "0.75", "k3": "nan", "acc": "0.25"}
    assert "acc" not in progress_postfix({"reward/mean": 0.75})


class _SilentEvalSource:
    """A rollout source wrapper whose eval engine answers every prompt with an empty response."""

    def __init__(self, source):
        self.source = source

    def eval_engine(self):
        class Empty:
            def greedy(self, prompts, max_new_tokens):
                return [[] for _ in prompts]

        return Empty()

    def __getattr__(self, name):
        return getattr(self.source, name)


@pytest.mark.parametrize("eval_policy", ["engine", "trainer"])
def test_eval_policy_picks_the_model_the_eval_runs(tiny_model_dir, tmp_path, eval_policy):
    from nearpolicy.training import assemble as setup
    from nearpolicy.engines.hf import HFEngine
    from nearpolicy.training.trainer import open_trainer

    def build(cfg, run_dir, log):
        session, source = setup.assemble(cfg, run_dir, log)
        return session, _SilentEvalSource(source)

    cfg = load_config(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "run.name=e",
                             "run.threads=1", "task.eval_size=3", "sampling.max_new_tokens=5", "engine.kind=hf",
                             "logging.tensorboard=false", "model.max_context=256", f"logging.eval_policy={eval_policy}"])
    trainer = open_trainer(cfg, log=lambda _: None, build=build)
    try:
        metrics = trainer.evaluate()
        prompts = [trainer.s.prompt_ids(p) for p in trainer.s.task.eval_problems()]
        policy = HFEngine(trainer.s.model, trainer.s.stop_ids).greedy(prompts, 5)
    finally:
        trainer.close()
    expected = sum(map(len, policy)) / 3 if eval_policy == "trainer" else 0.0
    assert expected > 0 or eval_policy == "engine"
    assert metrics["eval/response_length"] == pytest.approx(expected, abs=1e-9)
    assert trainer.s.plan["eval_policy"] == {"engine": "rollout engine", "trainer": "trainer:fp32"}[eval_policy]


def test_a_resumed_run_shows_the_last_eval_accuracy_from_its_metrics(tmp_path):
    from nearpolicy.runs.start_checks import last_eval_accuracy

    rows = [{"step": 0, "eval/accuracy": 0.125}, {"step": 1, "reward/mean": 0.5}, {"step": 2, "eval/accuracy": 0.375},
            {"step": 3, "eval/accuracy": 0.625}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert last_eval_accuracy(tmp_path, 2) == 0.375  # step 3's row is after the checkpoint: not counted
    assert last_eval_accuracy(tmp_path, 1) == 0.125
    assert accuracy_figure(last_eval_accuracy(tmp_path, 2)) == {"acc": "0.38"} and accuracy_figure(None) == {}
    (tmp_path / "metrics.jsonl").write_text("{not json\n{}\n")
    assert last_eval_accuracy(tmp_path, 2) is None


def test_resume_restores_the_progress_accuracy(tiny_model_dir, tmp_path):
    from nearpolicy.training.trainer import open_trainer

    _tiny_run(tiny_model_dir, tmp_path, "logging.checkpoint_every=1")
    cfg = load_config(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "run.name=tracked",
                             "run.steps=3", "run.threads=1", "algorithm.prompts_per_step=1", "algorithm.group_size=2",
                             "algorithm.micro_batch_size=2", "sampling.max_new_tokens=4", "task.eval_size=2",
                             "task.train_size=20", "logging.eval_every=1", "logging.checkpoint_every=1",
                             "logging.progress=false", "model.max_context=256", "engine.kind=hf"])
    last = [json.loads(line) for line in (tmp_path / "tracked" / "metrics.jsonl").read_text().splitlines()][-1]
    trainer = open_trainer(cfg, resume=True, log=lambda _: None)
    try:
        assert trainer.state.step == 2
        assert trainer.postfix == {"acc": f"{last['eval/accuracy']:.2f}"}
    finally:
        trainer.close()
