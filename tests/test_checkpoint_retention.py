"""What a training run of the tiny model leaves on disk, for real: the step_N folders after each save
(logging.keep_checkpoints), what a crash leaves to resume from with keep_checkpoints = 1, and the weights-only last
checkpoint (logging.final_weights_only) that a --resume refuses, naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from nearpolicy.config.schema import load_config
from nearpolicy.runs.folder import RunExistsError, list_checkpoints


FULL = ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"]
WEIGHTS_ONLY = ["model.safetensors", "rng.safetensors", "trainer_state.json"]


def _cfg(model_dir: Path, out: Path, *extra: str):
    return load_config(None, [f"model.path='{model_dir}'", f"run.output_dir='{out}'", "run.name=r", "run.steps=3",
                              "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                              "algorithm.micro_batch_size=2", "sampling.max_new_tokens=4", "task.eval_size=2",
                              "task.train_size=50", "logging.eval_every=100", "logging.checkpoint_every=1",
                              "logging.final_weights_only=true", "logging.tensorboard=false",
                              "logging.progress=false", "model.max_context=256", "engine.kind=hf", *extra])


@pytest.fixture
def saves(monkeypatch) -> list[dict[str, list[str]]]:
    """After each checkpoint the trainer saves: {checkpoint folder: its files} of every checkpoint on disk."""
    from nearpolicy.training import trainer as trainer_module

    real, seen = trainer_module.save_checkpoint, []

    def save(run_dir, *args, **kwargs):
        path = real(run_dir, *args, **kwargs)
        seen.append({p.name: sorted(f.name for f in p.iterdir()) for p in list_checkpoints(run_dir)})
        return path

    monkeypatch.setattr(trainer_module, "save_checkpoint", save)
    return seen


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def test_keep_2_deletes_each_older_checkpoint_once_a_newer_is_saved_and_the_last_is_weights_only(
        tiny_model_dir, tmp_path, saves):
    from nearpolicy.training.trainer import open_trainer

    cfg = _cfg(tiny_model_dir, tmp_path, "logging.keep_checkpoints=2")
    open_trainer(cfg, log=lambda _: None).fit(progress=False)
    assert saves == [{"step_000001": FULL}, {"step_000001": FULL, "step_000002": FULL},
                     {"step_000002": FULL, "step_000003": WEIGHTS_ONLY}]
    root = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]  # nothing temporary left
    # AdamW keeps two tensors per weight: the weights-only checkpoint is a third of a full one (+ rng and json)
    assert _bytes(root / "step_000003") / _bytes(root / "step_000002") == pytest.approx(1 / 3, abs=0.005)

    with pytest.raises(RunExistsError, match=r"logging.final_weights_only = true.*nearpolicy export.*delete it to "
                                             r"resume from step_000002"):
        open_trainer(_cfg(tiny_model_dir, tmp_path, "logging.keep_checkpoints=2", "run.steps=4"), resume=True)


def test_keep_1_leaves_the_last_checkpoint_after_a_crash_and_only_the_last_step_at_the_end(
        tiny_model_dir, tmp_path, saves):
    from nearpolicy.training.trainer import open_trainer

    cfg = _cfg(tiny_model_dir, tmp_path, "logging.keep_checkpoints=1")
    trainer = open_trainer(cfg, log=lambda _: None)
    step = trainer.train_step

    def crash_in_step_3():
        if trainer.state.step == 2:
            raise RuntimeError("crash in step 3")
        return step()

    trainer.train_step = crash_in_step_3
    with pytest.raises(RuntimeError, match="crash in step 3"):
        trainer.fit(progress=False)
    trainer.close()
    assert saves == [{"step_000001": FULL}, {"step_000002": FULL}]

    resumed = open_trainer(cfg, resume=True, log=lambda _: None)
    assert resumed.state.step == 2
    resumed.fit(progress=False)
    assert saves[2:] == [{"step_000003": WEIGHTS_ONLY}]
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_000003"]
    with pytest.raises(RunExistsError, match=r"logging.final_weights_only = true.*exported folder$"):
        open_trainer(_cfg(tiny_model_dir, tmp_path, "logging.keep_checkpoints=1", "run.steps=4"), resume=True)
