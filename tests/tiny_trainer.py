"""A Trainer on conftest's tiny model with the hf engine, wrapped task and engine, 2 prompts x 4 samples of up to 6
tokens a step and no evals or checkpoints unless asked: the in-process runs of tests/test_mipu.py and
tests/test_popo.py."""

from __future__ import annotations

from nearpolicy.config.schema import load_config

SETTINGS = ["run.steps=3", "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
            "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6", "task.eval_size=2", "task.train_size=50",
            "logging.eval_every=100", "logging.checkpoint_every=100", "logging.tensorboard=false",
            "logging.progress=false", "model.max_context=256", "engine.kind=hf"]


def tiny_trainer(model_dir, out, name, sets, wrap_task, wrap_engine, resume=False, log=lambda _: None):
    """(Trainer, its engine as `wrap_engine` wrapped it) of run `name` in `out`: SETTINGS, then `sets` (a list of
    key=value overrides); the session's task is `wrap_task(task)`; `log` gets the start-up lines."""
    from nearpolicy.training import assemble as setup
    from nearpolicy.training.trainer import open_trainer

    engines = []

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = wrap_task(session.task)
        engines.append(wrap_engine(setup.build_engine(cfg, session)))
        return session, setup.build_rollouts(cfg, session, engines[0], log)

    cfg = load_config(None, [f"model.path='{model_dir}'", f"run.output_dir='{out}'", f"run.name={name}", *SETTINGS,
                             *sets])
    trainer = open_trainer(cfg, resume=resume, log=log, build=build)
    return trainer, engines[0]


def step(trainer) -> dict[str, float]:
    """One training step as the run loop takes it: the row, then the step count."""
    row = trainer.train_step()
    trainer.state.step += 1
    return row
