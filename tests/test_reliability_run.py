"""Faults provoked for real inside a training run on the tiny model (in process: the Trainer, or the CLI's `main`):
a hostile engine (empty completions, out-of-vocabulary ids, a crash), a raising reward, NaN losses and weights,
a full disk during the engine GGUF export, a SIGINT mid-step, prompts too long for the context, damaged model
files (docs/reliability.md lists each fault and its test)."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from nearpolicy.config.schema import Config, load_config
from nearpolicy.training.guards import NonFiniteError, step_fault
from nearpolicy.runs.folder import list_checkpoints


# ---------------------------------------------------------------- the trainer under hostile engines, rewards, NaNs
def _cfg(model_path, out: Path, *extra: str) -> Config:
    return load_config(None, [f"model.path='{model_path}'", f"run.output_dir='{out}'", "run.name=t", "run.steps=2",
                              "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                              "algorithm.micro_batch_size=2", "sampling.max_new_tokens=6", "task.eval_size=4",
                              "task.train_size=50", "logging.eval_every=100", "logging.checkpoint_every=1",
                              "logging.tensorboard=false", "logging.progress=false", "model.max_context=256",
                              "engine.kind=hf", *extra])


def _trainer(tiny_model_dir, tmp_path, *extra: str, rewrite=None):
    """A Trainer on the tiny model; with `rewrite`, its rollout source samples from a hostile engine (the real one
    with each rollout passed through `rewrite`), handed in through setup's assembly."""
    from nearpolicy.training import assemble as setup
    from nearpolicy.training.trainer import open_trainer

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        engine = setup.build_engine(cfg, session)
        return session, setup.build_rollouts(cfg, session, _Rewriting(engine, rewrite) if rewrite else engine, log)

    logs: list[str] = []
    return open_trainer(_cfg(tiny_model_dir, tmp_path, *extra), log=logs.append, build=build), logs


class _Rewriting:
    """The real engine, with each sampled rollout passed through `rewrite` (a hostile engine)."""

    def __init__(self, engine, rewrite):
        self.engine, self.rewrite = engine, rewrite

    def generate(self, requests, sampling, seed):
        return [self.rewrite(r) for r in self.engine.generate(requests, sampling, seed)]

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.s.model.state_dict().items()}


def test_engine_returning_empty_completions_gives_a_zero_update(tiny_model_dir, tmp_path):
    from nearpolicy.types import Rollout

    trainer, _ = _trainer(tiny_model_dir, tmp_path, rewrite=lambda r: Rollout(r.group_id, r.sample_index,
                                                                                r.prompt_ids, [], [], [], "length"))
    before = _weights(trainer)
    metrics = trainer.train_step()
    assert metrics["response/length_mean"] == 0.0 and metrics["reward/mean"] == 0.0
    assert metrics["actor/loss"] == 0.0 and metrics["actor/grad_norm"] == 0.0
    assert step_fault(metrics) is None
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing to learn from, nothing learnt


def test_engine_token_id_outside_the_vocabulary_is_named(tiny_model_dir, tmp_path):
    from dataclasses import replace

    trainer, _ = _trainer(tiny_model_dir, tmp_path,
                          rewrite=lambda r: replace(r, completion_ids=[49157] * len(r.completion_ids)))
    with pytest.raises(ValueError, match=r"token ids \[49157, 49157.*outside the vocabulary \[0, 49152\)"):
        trainer.train_step()
    assert trainer.state.data_position == 0  # the step was not counted


class FlakyTask:
    """Raises on the 2nd and 3rd reward call of every 4 (counted in the scoring process), else scores 1."""

    name = "flaky"

    def __init__(self):
        self.calls = 0

    def score(self, response, problem):
        self.calls += 1
        if self.calls % 4 in (2, 3):
            raise RuntimeError("checker crashed")
        return 1.0


def test_unscorable_samples_leave_the_group_statistics_get_advantage_0_and_are_counted(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """Group [1, error, error, 1] through the trainer's scoring: rewards [1, nan, nan, 1], advantages 0 for all
    (counting the errors as 0 would give [0.87, -0.87, -0.87, 0.87]), reward/mean 1 over the scorable samples."""
    from nearpolicy.training import trainer as trainer_module
    from nearpolicy.tasks.scoring import BoundedScorer

    trainer, logs = _trainer(tiny_model_dir, tmp_path, "algorithm.group_size=4", "algorithm.prompts_per_step=1")
    trainer.scorer.close()
    trainer.scorer = BoundedScorer(FlakyTask(), 10.0)
    seen, real = [], trainer_module.compute_advantages

    def recorded(name, rewards, groups):
        seen.append((rewards, real(name, rewards, groups)))
        return seen[-1][1]

    monkeypatch.setattr(trainer_module, "compute_advantages", recorded)
    first = trainer.train_step()
    ((rewards, result),) = seen
    assert rewards[0] == 1.0 and rewards[3] == 1.0 and torch.isnan(rewards[1:3]).all()
    assert torch.allclose(result.advantages.double(), torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert first["reward/mean"] == 1.0 and first["reward/std"] == 0.0
    assert first["reward/unscorable"] == 2.0 and first["reward/timeouts"] == 0.0 and first["reward/scorer_errors"] == 2.0
    assert any("2 of 4 reward call(s) unscorable, e.g. RuntimeError: checker crashed" in m for m in logs)
    assert trainer.train_step()["reward/scorer_errors"] == 4.0  # cumulative
    assert trainer.rollouts.engine.stop_ids == {0, 2, 4} and trainer.s.plan["stop_token_ids"] == [0, 2, 4]  # llama.cpp's EOG
    trainer.close()


def test_resume_on_changed_jsonl_data_is_refused_naming_the_change(tiny_model_dir, tmp_path):
    """Appending 11 lines to a 100-line task and resuming: refused before anything loads, saying what changed."""
    import hashlib

    from nearpolicy.runs.folder import RunExistsError
    from nearpolicy.training.trainer import open_trainer

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(100)))
    before = hashlib.sha256(data.read_bytes()).hexdigest()
    extra = ("task.kind=jsonl", f"task.path='{data}'")
    trainer, _ = _trainer(tiny_model_dir, tmp_path, *extra)
    plan = json.loads((trainer.run_dir / "plan.json").read_text())
    assert plan["data"] == {"kind": "jsonl", "path": str(data), "resolved": str(data.resolve()), "sha256": before,
                            "bytes": data.stat().st_size, "lines": 100}
    trainer.close()
    with data.open("a") as handle:
        handle.write("".join(json.dumps({"prompt": f"What is {i} - 1?", "answer": i - 1}) + "\n" for i in range(11)))
    after = hashlib.sha256(data.read_bytes()).hexdigest()
    with pytest.raises(RunExistsError, match=rf"--resume on changed data: task\.path data\.jsonl changed: 100 -> 111 "
                                             rf"lines, \d+ -> \d+ bytes, sha256 {before[:12]} -> {after[:12]}"):
        open_trainer(_cfg(tiny_model_dir, tmp_path, *extra), resume=True, log=lambda m: None)


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """NaN advantages (a NaN loss and gradient) at steps 1, 3 and 4, +-1 at step 2; run.max_bad_steps = 2 stops the
    run at step 4."""
    from dataclasses import replace

    from nearpolicy.training import trainer as trainer_module

    trainer, logs = _trainer(tiny_model_dir, tmp_path, "run.steps=6", "run.max_bad_steps=2")
    real, calls, snapshots = trainer_module.compute_advantages, [], []

    def poisoned(*args):
        calls.append(1)
        snapshots.append(_weights(trainer))
        adv = real(*args)
        signs = torch.tensor([1.0, -1.0]).repeat(len(adv.advantages) // 2)  # random-model rewards are all 0
        return replace(adv, advantages=signs * (float("nan") if len(calls) in (1, 3, 4) else 1.0))

    monkeypatch.setattr(trainer_module, "compute_advantages", poisoned)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps up to step 4 had a non-finite loss or gradient"):
        trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["guard/bad_steps"] for r in rows[1:]] == [1.0, 1.0, 2.0, 3.0]
    assert [r["guard/consecutive_bad_steps"] for r in rows[1:]] == [1.0, 0.0, 1.0, 2.0]
    assert [r["actor/skipped_minibatches"] for r in rows[1:]] == [1.0, 0.0, 1.0, 1.0]
    assert rows[1]["actor/loss"] is None  # NaN is written as null
    assert "warning: step 1: 1 mini-batch(es) skipped: non-finite loss and gradient norm" in "\n".join(logs)
    now = _weights(trainer)
    assert all(torch.equal(snapshots[0][k], snapshots[1][k]) for k in now)  # bad step 1 left the weights alone
    assert not all(torch.equal(snapshots[1][k], snapshots[2][k]) for k in now)  # good step 2 moved them
    assert all(torch.equal(snapshots[2][k], now[k]) for k in now)  # bad steps 3 and 4 did not
    assert json.loads((trainer.run_dir / "checkpoints" / "step_000004" / "trainer_state.json").read_text())[
        "consecutive_bad_steps"] == 2


def test_non_finite_weights_are_never_exported_or_saved(tiny_model_dir, tmp_path):
    trainer, _ = _trainer(tiny_model_dir, tmp_path)
    trainer.checkpoint()  # step 0
    with torch.no_grad():
        trainer.s.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    version = trainer.rollouts.engine.version
    with pytest.raises(NonFiniteError, match=r"weights became non-finite at step 1 \(model.layers.0.mlp.up_proj.weight\)"):
        trainer.train_step()
    assert trainer.rollouts.engine.version == version  # the engine never got them
    with pytest.raises(FloatingPointError, match="refusing to checkpoint non-finite weights"):
        trainer.checkpoint()
    assert [p.name for p in list_checkpoints(trainer.run_dir)] == ["step_000000"]


# ---------------------------------------------------------------- the real CLI, in process, with a fault injected
def _cli(model_path, out: Path, capsys, *extra: str, resume: bool = False) -> tuple[int, str]:
    from nearpolicy.cli import main

    sets = [f"model.path='{model_path}'", f"run.output_dir='{out}'", "run.name=c", "run.steps=2", "run.threads=1",
            "algorithm.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=2",
            "sampling.max_new_tokens=6", "task.eval_size=4", "task.train_size=50", "logging.eval_every=100",
            "logging.checkpoint_every=1", "logging.tensorboard=false", "logging.progress=false",
            "model.max_context=256", *extra]
    capsys.readouterr()
    rc = main(["train", *[a for s in sets for a in ("--set", s)], *(["--resume"] if resume else [])])
    return rc, capsys.readouterr().err


@pytest.mark.slow
def test_disk_full_during_the_engine_gguf_sync_keeps_checkpoint_and_engine_file(tiny_gguf_factory, tmp_path,
                                                                               capsys, monkeypatch):
    """The engine's GGUF is written whole at startup, then each step's sync rewrites its tensors in place
    (engines/gguf/inplace.py). Step 2's rewrite hits ENOSPC half-way: the run stops naming the file and the last
    checkpoint, the file stays a complete GGUF, and the resumed run writes it whole again and finishes."""
    from nearpolicy.engines.gguf import inplace as gguf_inplace
    from nearpolicy.model.load import resolve_model

    model = tiny_gguf_factory("f32")
    real, calls = gguf_inplace.rewrite, []

    def filling(path, slots, tensors):
        calls.append(1)
        if len(calls) == 2:
            half = dict(list(tensors.items())[: len(tensors) // 2])
            real(path, {name: slots[name] for name in half}, half)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, slots, tensors)

    monkeypatch.setattr(gguf_inplace, "rewrite", filling)
    rc, err = _cli(model, tmp_path, capsys, "engine.precision=q8_0")
    run = tmp_path / "c"
    assert rc == 1, err
    assert (f"error: [Errno 28] could not write the engine GGUF {run}/engine/policy-q8_0.gguf (No space left on "
            f"device); policy-q8_0.gguf is partly rewritten (the next weight sync writes it whole) at step 1; the last "
            f"checkpoint {run}/checkpoints/step_000001 is intact (continue: ") in err
    assert f"nearpolicy train --resume {run})" in err  # the command as this process was started
    assert sorted(p.name for p in (run / "engine").iterdir()) == ["llamacpp.log", "policy-q8_0.gguf", "vocab.gguf"]
    assert resolve_model(str(run / "engine" / "policy-q8_0.gguf")).kind == "gguf"  # complete, readable
    state = json.loads((run / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert (state["step"], state["version"], state["engine_precision"]) == (1, 1, "q8_0")
    monkeypatch.undo()
    rc, err = _cli(model, tmp_path, capsys, "engine.precision=q8_0", resume=True)
    assert rc == 0, err
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert (state["step"], state["version"]) == (2, 2)


@pytest.mark.slow
def test_engine_error_stops_the_run_with_the_checkpoint_named(tiny_gguf_factory, tmp_path, capsys, monkeypatch):
    from nearpolicy.engines.process import CRASH_HOOK

    monkeypatch.setenv(CRASH_HOOK, "generate:2:raise")  # an EngineError raised inside the engine process
    rc, err = _cli(tiny_gguf_factory("f32"), tmp_path, capsys)
    assert rc == 1
    assert (f"error: injected engine failure in generate (test hook {CRASH_HOOK}) at step 1; the last checkpoint "
            f"{tmp_path}/c/checkpoints/step_000001 is intact (continue: nearpolicy train --resume {tmp_path}/c)") in err
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("hook, said", [("generate:2", "rollout of step 2"), ("greedy:2", "eval of step 2")])
def test_engine_sigsegv_keeps_the_trainer_and_its_checkpoint_and_resume_continues(tiny_gguf_factory, tmp_path, capsys,
                                                                                  monkeypatch, hook, said):
    """A real SIGSEGV of the engine's process mid-rollout and mid-eval; --resume after changing the precision."""
    from nearpolicy.engines.process import CRASH_HOOK

    monkeypatch.setenv(CRASH_HOOK, hook)
    rc, err = _cli(tiny_gguf_factory("f32"), tmp_path, capsys, "engine.precision=q8_0")
    assert rc == 1, err
    assert f"error: engine llamacpp:q8_0 died with SIGSEGV during {said}; last lines of its log:" in err
    assert "Fatal Python error: Segmentation fault" in err  # the child's own stack, from its log
    assert (f"the last checkpoint {tmp_path}/c/checkpoints/step_000001 is intact (continue: nearpolicy train "
            f"--resume {tmp_path}/c); "
            "engine.precision and engine.extra_buffers may change on --resume") in err
    assert "try --set engine.precision=f16" in err
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    monkeypatch.delenv(CRASH_HOOK)
    rc, err = _cli(tiny_gguf_factory("f32"), tmp_path, capsys, "engine.precision=f16", resume=True)
    assert rc == 0, err
    assert f"resumed from {tmp_path}/c/checkpoints/step_000001 at step 1" in err
    assert "engine.precision changes on resume: q8_0 -> f16" in err  # the checkpoint's engine_precision, read
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


@pytest.mark.slow
def test_engine_failing_its_startup_probe_stops_at_once_and_leaves_no_run_folder(tiny_gguf_factory, tmp_path, capsys,
                                                                                 monkeypatch):
    from nearpolicy.engines.process import CRASH_HOOK

    monkeypatch.setenv(CRASH_HOOK, "probe:1")
    rc, err = _cli(tiny_gguf_factory("f32"), tmp_path, capsys, "engine.precision=q8_0", "engine.extra_buffers=true")
    assert rc == 2
    assert "error: engine llamacpp:q8_0 died with SIGSEGV during startup probe; last lines of its log:" in err
    assert ("the llama.cpp engine failed on this machine; try --set engine.extra_buffers=false (llama.cpp's AMX / "
            "repack buffers, ggml-org/llama.cpp#20824), or --set engine.precision=f16") in err
    assert not (tmp_path / "c").exists()  # nothing blocks the retry
    monkeypatch.delenv(CRASH_HOOK)
    rc, err = _cli(tiny_gguf_factory("f32"), tmp_path, capsys, "engine.precision=q8_0", "run.steps=1")
    assert rc == 0, err


@pytest.mark.slow
def test_prompt_longer_than_the_context_fails_at_startup(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i} for i in range(6)]
    rows[3]["prompt"] = "What is " + " + ".join(["1"] * 150) + "?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err = _cli(tiny_model_dir, tmp_path, capsys, "engine.kind=hf", "task.kind=jsonl", f"task.path='{data}'",
                   "task.eval_size=2")
    assert rc == 2
    assert "error: 1 prompt(s) longer than model.max_context (256) minus sampling.max_new_tokens (6) = 250 tokens: " in err
    assert "problem" in err and "raise model.max_context" in err
    assert not (tmp_path / "c" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_resume_of_a_run_that_never_existed_says_it_starts_fresh(tiny_model_dir, tmp_path, capsys):
    rc, err = _cli(tiny_model_dir, tmp_path, capsys, "engine.kind=hf", "run.steps=1", resume=True)
    assert rc == 0
    assert f"no loadable checkpoint in {tmp_path}/c: starting from step 0" in err
    assert [p.name for p in list_checkpoints(tmp_path / "c")] == ["step_000001"]


def test_damaged_or_missing_model_files_exit_2_naming_the_file(tiny_model_dir, tiny_gguf_factory, tmp_path, capsys):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_model_dir, hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a real truncation
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(tiny_gguf_factory("f32").read_bytes()[:200_000])
    cases = [(hf, f"error: model.path '{hf}': cannot load the model from {hf} (SafetensorError: "),
             (gguf_file, f"{gguf_file} is not a valid GGUF file (bad magic or truncated)"),
             (tmp_path / "missing.gguf", f"model.path '{tmp_path}/missing.gguf' does not exist")]
    for path, needle in cases:
        rc, err = _cli(path, tmp_path, capsys, "engine.kind=hf")
        assert rc == 2 and needle in err, err[-2000:]
        assert "Traceback" not in err
    assert not (tmp_path / "c" / "checkpoints").exists()



def test_sigint_mid_step_finishes_the_step_and_checkpoints_it(tiny_model_dir, tmp_path, monkeypatch):
    """A real SIGINT to this process during step 2 (checkpoint_every = 100: only the stop writes one)."""
    from nearpolicy.training import trainer as trainer_module
    from nearpolicy.signals import GracefulStop, StopRequested

    trainer, _ = _trainer(tiny_model_dir, tmp_path, "run.steps=5", "logging.checkpoint_every=100")
    real, calls = trainer_module.compute_advantages, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(trainer_module, "compute_advantages", interrupted)
    with GracefulStop() as stop, pytest.raises(StopRequested) as stopped:
        trainer.fit(stop)
    saved = trainer.run_dir / "checkpoints" / "step_000002"
    assert str(stopped.value) == f"stopped by SIGINT at step 2; checkpoint {saved} (continue: nearpolicy train --resume {trainer.run_dir})"
    assert stopped.value.exit_code == 130 and len(calls) == 2
    assert list_checkpoints(trainer.run_dir) == [saved]
    assert json.loads((saved / "trainer_state.json").read_text())["step"] == 2
    assert [json.loads(r)["step"] for r in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_resume_past_a_checkpoint_damaged_after_its_weights_restarts_from_the_initial_weights(tiny_model_dir, tmp_path):
    """The only checkpoint has intact weights but a truncated optimizer file: --resume starts over from step 0 with
    model.path's weights, not the damaged checkpoint's (a partial load must not leak)."""
    from nearpolicy.training.trainer import open_trainer

    extra = ("logging.keep_checkpoints=1", "algorithm.lr=0.01", "algorithm.weight_decay=0.5")  # decay moves weights
    trainer, _ = _trainer(tiny_model_dir, tmp_path, *extra)
    initial = _weights(trainer)
    trainer.fit()
    (ckpt,) = list_checkpoints(trainer.run_dir)
    assert any(not torch.equal(initial[k], v) for k, v in _weights(trainer).items())  # the weights moved
    optimizer_file = ckpt / "optimizer.safetensors"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:100])
    logs: list[str] = []
    resumed = open_trainer(_cfg(tiny_model_dir, tmp_path, *extra), resume=True, log=logs.append)
    assert any("is not loadable" in m for m in logs) and any("starting from step 0" in m for m in logs)
    assert resumed.state.step == 0
    assert all(torch.equal(initial[k], v) for k, v in _weights(resumed).items())


def test_a_checkpoint_that_cannot_be_written_is_said_once_with_the_resume_command(tmp_path):
    """The new-user trial's full disk: the error named the intact checkpoint twice ("... is intact at step 10; the
    last checkpoint ... is intact"), the first time as if it held step 10."""
    from types import SimpleNamespace

    from nearpolicy.runs.folder import CheckpointError
    from nearpolicy.training.run import fit

    said = ("could not write checkpoint c/checkpoints/step_000010 (No space left on device); the previous checkpoint "
            "c/checkpoints/step_000008 is intact")

    def fails(stop, progress=True):
        raise CheckpointError(said)

    trainer = SimpleNamespace(fit=fails, run_dir=tmp_path / "c", state=SimpleNamespace(step=10), cfg=None,
                              close=lambda: None)
    rc, message = fit(trainer, SimpleNamespace(signum=None))
    assert rc == 1
    assert message.startswith(f"error at step 10: {said} (continue: ")
    assert message.endswith(f"train --resume {tmp_path / 'c'})")  # the command as this process was started
    assert message.count("is intact") == 1
