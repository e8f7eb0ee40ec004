"""Faults provoked for real, without a training run: full disk and kills during a checkpoint write, non-finite
weights, the non-finite step guard, long prompts, bad dataset lines, signals, and fuzzed configs and reward inputs
(docs/reliability.md lists each fault and its test).

Faults inside a training run (hostile engine, NaN steps, crashes, damaged model files) are in
test_reliability_run.py; whole processes stopped by SIGTERM / SIGKILL are in test_reliability_cli.py."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nearpolicy.runs import start_checks as resume
from nearpolicy.runs import folder as runs
from nearpolicy.config.schema import Config, ConfigError, load_config
from nearpolicy.training.guards import BadStepGuard, NonFiniteError, check_prompt_lengths, step_fault
from nearpolicy.runs.folder import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint


# ---------------------------------------------------------------- checkpoints: full disk, non-finite weights, kills
def _small_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 512x512 linear layer (1 MiB of weights, 2 MiB of Adam state) after one optimizer step, computed on one
    thread: bit for bit what _KILL_SCRIPT's process computes, whatever thread count an earlier test in this worker
    left (a gradient summed on 2 threads differs in its last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = torch.nn.Linear(512, 512, dtype=torch.float32)  # explicit: the sizes below assume 4-byte weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 512, dtype=torch.float32)).sum().backward()
        opt.step()
    finally:
        torch.set_num_threads(threads)
    return model, opt


def _assert_loads_as(path: Path, model: torch.nn.Module | dict) -> dict:
    """Load `path` into a different model; its weights must equal `model`'s (a module or a state dict) bit for bit."""
    fresh, opt = _small_model(seed=1)
    state = load_checkpoint(path, fresh, opt)
    expected = model if isinstance(model, dict) else model.state_dict()
    for name, value in expected.items():
        assert torch.equal(fresh.state_dict()[name], value), name
    return state


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    model, opt = _small_model()
    first = save_checkpoint(tmp_path, 1, model, opt, {"data_position": 4}, keep=1)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}

    def fills_the_disk(tensors, filename):
        Path(filename).write_bytes(b"\0" * 1000)  # part of the file reached the disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runs, "save_file", fills_the_disk)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(CheckpointError, match=r"step_000002 \(No space left on device\); the previous checkpoint "
                                              r".*step_000001 is intact") as err:
        save_checkpoint(tmp_path, 2, model, opt, {"data_position": 8}, keep=1)
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # no temporary left
    assert _assert_loads_as(first, saved_weights)["data_position"] == 4


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_disk_full_on_a_real_small_tmpfs(tmp_path):
    """A 4 MiB tmpfs holds one 3 MiB checkpoint but not a second: the real ENOSPC of safetensors."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("mounting a tmpfs needs root (the failing-writer test above covers the same path)")
    try:
        model, opt = _small_model()
        first = save_checkpoint(disk, 1, model, opt, {}, keep=1)
        with pytest.raises(CheckpointError, match="No space left on device.*step_000001 is intact"):
            save_checkpoint(disk, 2, model, opt, {}, keep=1)
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step_000001"]
        _assert_loads_as(first, model)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_non_finite_weights_are_never_saved(tmp_path):
    model, opt = _small_model()
    first = save_checkpoint(tmp_path, 1, model, opt, {}, keep=2)
    with torch.no_grad():
        model.bias[3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite weights at step 2.*bias"):
        save_checkpoint(tmp_path, 2, model, opt, {}, keep=2)
    assert list_checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_kind_of_non_finite_weight_stops_the_export(bad):
    from nearpolicy.training.guards import check_finite_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    check_finite_weights(model, 1)  # finite: nothing raised
    with torch.no_grad():
        model[1].weight[1, 2] = bad
    with pytest.raises(NonFiniteError, match=r"non-finite at step 2 \(1.weight\)"):
        check_finite_weights(model, 2)


@pytest.mark.parametrize("saved_fused,run_fused", [(True, False), (False, True)])
def test_a_restored_optimizer_keeps_this_runs_implementation(saved_fused, run_fused):
    """Fused AdamW leaves parameter version counters alone (the aligned trainer's weight cache keys on them), so a
    resumed run keeps the implementation its own config chose, whatever the checkpoint's param_groups say; the
    moments and step restore either way and the next step is the same."""
    def make(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)

    model, opt = make(saved_fused)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
    tensors, meta = runs._flatten_optimizer(opt)
    tensors = {k: v.clone() for k, v in tensors.items()}  # as read back from disk: no tensor shared with `opt`
    restored_model, restored = make(run_fused)
    restored_model.load_state_dict(model.state_dict())
    runs._restore_optimizer(restored, tensors, meta)
    assert [g["fused"] for g in restored.param_groups] == [run_fused]
    version = restored_model.weight._version
    x = torch.randn(4, 64)
    for m, o in ((model, opt), (restored_model, restored)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert torch.allclose(restored_model.weight, model.weight, rtol=0, atol=1e-6)
    assert (restored_model.weight._version != version) == (not run_fused)


def test_training_uses_fused_adamw_unless_the_trainer_is_aligned(tiny_model_dir, tmp_path):
    from nearpolicy.training.assemble import build_session

    for alignment, fused in (("off", True), ("engine", False)):
        cfg = load_config(None, [f"model.path='{tiny_model_dir}'", f"algorithm.precision_alignment={alignment}",
                                 "task.train_size=20", "task.eval_size=4"])
        session = build_session(cfg, tmp_path / alignment, lambda *_: None)
        assert [g["fused"] for g in session.optimizer.param_groups] == [fused]


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from nearpolicy.runs import folder as runs
    from nearpolicy.runs.folder import save_checkpoint
    run_dir, where, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)  # as _small_model
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()

    def hang():
        ready.write_text("ready")
        time.sleep(600)

    save_checkpoint(run_dir, 1, model, opt, {"data_position": 4}, keep=1)
    if where == "mid-file":
        real = runs.save_file
        def half_then_hang(tensors, filename):
            real(tensors, filename)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            hang()
        runs.save_file = half_then_hang
    elif where == "before-rename":
        real_write = runs._write_checkpoint_files
        def written_then_hang(*args):
            real_write(*args)
            hang()
        runs._write_checkpoint_files = written_then_hang
    elif where == "mid-prune":
        real_rmtree = runs.shutil.rmtree
        def rmtree(path, ignore_errors=False):
            if str(path).endswith(".deleting") and Path(path).exists():
                (Path(path) / "model.safetensors").unlink()  # half deleted
                hang()
            real_rmtree(path, ignore_errors=ignore_errors)
        runs.shutil.rmtree = rmtree
    save_checkpoint(run_dir, 2, model, opt, {"data_position": 8}, keep=1)
""")


@pytest.mark.parametrize("where,survivor", [("mid-file", 1), ("before-rename", 1), ("mid-prune", 2)])
def test_sigkill_during_a_checkpoint_write_leaves_a_loadable_checkpoint(tmp_path, where, survivor):
    """A real SIGKILL of a process held at three moments of save_checkpoint(step 2) over a step-1 checkpoint."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path), where, str(ready)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == [f"step_{survivor:06d}"]
    model, _ = _small_model()
    assert _assert_loads_as(saved[-1], model)["data_position"] == 4 * survivor
    leftovers = {p.name for p in (tmp_path / "checkpoints").iterdir()} - {saved[-1].name}
    assert leftovers == ({".step_000002.tmp"} if survivor == 1 else {".step_000001.deleting"})
    model, opt = _small_model()
    save_checkpoint(tmp_path, 3, model, opt, {}, keep=1)  # the next save clears what the kill left
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]


# ---------------------------------------------------------------- non-finite guard (unit)
def test_step_fault_names_the_cause():
    assert step_fault({"actor/skipped_minibatches": 0.0, "actor/loss": 0.1, "actor/grad_norm": 1.0}) is None
    assert step_fault({"actor/skipped_minibatches": 1.0, "actor/loss": float("nan"),
                       "actor/grad_norm": float("nan")}) == "1 mini-batch(es) skipped: non-finite loss and gradient norm"
    assert step_fault({"actor/skipped_minibatches": 2.0, "actor/loss": 0.3,
                       "actor/grad_norm": float("inf")}) == "2 mini-batch(es) skipped: non-finite gradient norm"


def test_bad_step_guard_counts_and_stops_after_k_in_a_row():
    guard, logs = BadStepGuard(max_consecutive=2), []
    bad = {"actor/skipped_minibatches": 1.0, "actor/loss": float("nan"), "actor/grad_norm": float("nan")}
    good = {"actor/skipped_minibatches": 0.0, "actor/loss": 0.1, "actor/grad_norm": 1.0}
    seen = []
    for step, metrics in enumerate([bad, good, bad], start=1):
        seen.append(guard.observe(step, metrics, logs.append))
        guard.check(step)
    assert [m["guard/bad_steps"] for m in seen] == [1.0, 1.0, 2.0]
    assert [m["guard/consecutive_bad_steps"] for m in seen] == [1.0, 0.0, 1.0]
    assert logs[0] == "warning: step 1: 1 mini-batch(es) skipped: non-finite loss and gradient norm (1 in a row, 1 in this run)"
    guard.observe(4, bad, logs.append)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps up to step 4 .*run.max_bad_steps = 2"):
        guard.check(4)
    restored = BadStepGuard(2)
    restored.restore(guard.state())
    assert (restored.total, restored.consecutive) == (3, 2)


def test_a_step_whose_every_advantage_is_zero_is_warned_about():
    """group_size 1 with a group-relative estimator, or every group constant: the step trains on nothing (TRL #3199)."""
    from nearpolicy.ops.advantages import compute_advantages
    from nearpolicy.training.phases import advantage_signal

    singletons = compute_advantages("grpo", torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 2]))
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    idle = advantage_signal(singletons.advantages, singletons.keep, mask)
    assert idle == {"advantage/nonzero_frac": 0.0}
    mixed = compute_advantages("grpo", torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert advantage_signal(mixed.advantages, torch.tensor([True, True, True, False]),
                            torch.ones(4, 2, dtype=torch.bool)) == {"advantage/nonzero_frac": 2 / 3}
    token = torch.tensor([[0.0, 0.3], [0.0, 0.7], [0.0, 0.0]])  # [N, T]: row 1's 0.7 is at a masked token
    assert advantage_signal(token, torch.ones(3, dtype=torch.bool), mask)["advantage/nonzero_frac"] == 1 / 3
    assert advantage_signal(token, torch.ones(3, dtype=torch.bool), mask & False)["advantage/nonzero_frac"] == 0.0
    logs = []
    BadStepGuard(3).observe(5, {**idle, "actor/skipped_minibatches": 0.0}, logs.append)
    assert logs == ["warning: step 5: no sample has a nonzero advantage (every group constant, a singleton or "
                    "unscorable): the policy-gradient term of this step trains on nothing"]
    BadStepGuard(3).observe(6, {"advantage/nonzero_frac": 0.25, "actor/skipped_minibatches": 0.0}, logs.append)
    assert len(logs) == 1


def test_prompt_longer_than_the_context_is_named():
    prompt_ids = lambda problem: list(range(problem))  # noqa: E731 - a "problem" here is its prompt length
    check_prompt_lengths(prompt_ids, {"train": [10, 20], "eval": [26]}, max_context=32, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"2 prompt\(s\) longer than model.max_context \(32\) minus "
                                         r"sampling.max_new_tokens \(6\) = 26 tokens: train problem 1 \(27 tokens\), "
                                         r"eval problem 0 \(40 tokens\)"):
        check_prompt_lengths(prompt_ids, {"train": [10, 27], "eval": [40]}, max_context=32, max_new_tokens=6)
    with pytest.raises(ValueError, match="leaves no room"):
        check_prompt_lengths(prompt_ids, {"train": [1]}, max_context=16, max_new_tokens=16)


# ---------------------------------------------------------------- hostile datasets and model files
def test_jsonl_line_that_is_not_utf8_is_numbered_and_skippable(tmp_path):
    from nearpolicy.tasks.jsonl import JsonlTask

    path = tmp_path / "data.jsonl"
    good = [json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}).encode() for i in range(4)]
    path.write_bytes(b"\n".join(good[:2] + [b'{"prompt": "caf\xe9?", "answer": 1}'] + good[2:]) + b"\n")
    with pytest.raises(ValueError, match=r"1 bad line\(s\) at \[3\]: line 3: not UTF-8 \(byte 0xe9 at column 16\)"):
        JsonlTask(path, 1, 0, 1)
    task = JsonlTask(path, 1, 0, 1, skip_bad_lines=True)
    assert task.skipped_lines == [3] and task.train_size + len(task.eval_problems()) == 4


# ---------------------------------------------------------------- fuzzing: the config loader, the reward path
_FIELDS = {section: list(field.annotation.model_fields) for section, field in Config.model_fields.items()}
_KNOWN_KEYS = [f"{section}.{key}" for section, keys in _FIELDS.items() for key in keys]
_KEY = st.sampled_from(_KNOWN_KEYS) | st.text(alphabet="abcdrunstep._", min_size=1, max_size=14)
_SCALAR = (st.integers(-2**70, 2**70) | st.floats() | st.booleans() | st.text(max_size=12)
           | st.sampled_from(["q8_0", "hf", "grpo", "tis", "jsonl", "token-mean", "none", "bypass", "x.jsonl"]))
_VALUE = _SCALAR | st.lists(_SCALAR, max_size=3) | st.dictionaries(st.sampled_from(["a", "min_terms", "x_y"]),
                                                                      _SCALAR, max_size=3)


def _toml(value) -> str:
    """A TOML literal (possibly invalid TOML for odd strings: the loader must still give a ConfigError)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _loads_or_config_error(path, overrides) -> Config | None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        assert str(err)
        return None
    assert Config.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json")))) == cfg  # config.json reloads
    return cfg


def _plausible(key: str):
    """A value of the key's default type, in a range where many are valid (about 1 config in 7 loads)."""
    section, name = key.split(".")
    default = getattr(getattr(Config(), section), name)
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(0, 64)
    if isinstance(default, float):
        return st.floats(0, 2)
    return st.sampled_from(["q8_0", "f32", "hf", "grpo", "rloo", "tis", "token_mis", "gspo", "k2", "fp32", "x"])


_OVERRIDE = (st.sampled_from(_KNOWN_KEYS).flatmap(lambda k: st.tuples(st.just(k), _plausible(k).map(_toml)))
             | st.tuples(_KEY, _VALUE.map(_toml) | st.text(max_size=15)))


@settings(max_examples=400, deadline=None)
@given(st.lists(_OVERRIDE, max_size=4))
def test_fuzz_overrides_give_a_config_or_a_config_error(pairs):
    _loads_or_config_error(None, [f"{key}={raw}" for key, raw in pairs])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(list(_FIELDS)) | st.text("abc", min_size=1, max_size=3),
                       st.dictionaries(st.sampled_from(sum(_FIELDS.values(), [])) | st.text("xyz", min_size=1, max_size=3),
                                       _VALUE, max_size=4), max_size=4) | st.binary(max_size=40))
def test_fuzz_config_files_give_a_config_or_a_config_error(tmp_path, document):
    path = tmp_path / "c.toml"
    if isinstance(document, bytes):
        path.write_bytes(document)
    else:
        path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in t.items())
                                for s, t in document.items()), encoding="utf-8", errors="surrogatepass")
    _loads_or_config_error(path, [])


_RESPONSE = (st.lists(st.sampled_from(list("0123456789-+.,/${}\\ \n:x") + ["\\boxed{", "\\frac{", "Answer:",
                                                                           "The answer is ", "\\fbox{"]),
                      max_size=25).map("".join) | st.text(max_size=50))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_RESPONSE, _RESPONSE | st.sampled_from(["7", "-3", "0.5", "\\frac{1}{2}", "(1, 2)"]))
def test_fuzz_reward_path_scores_0_or_1_and_never_raises(tmp_path, response, reference):
    """The trainer's reward path (safe_score over a JSONL task: extraction + math-verify) on random text."""
    from nearpolicy.tasks import Problem
    from nearpolicy.tasks.base import safe_score
    from nearpolicy.tasks.jsonl import JsonlTask

    path = tmp_path / "d.jsonl"
    if not path.exists():
        path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    task = JsonlTask(path, 0, 0, 1)
    reward, error = safe_score(task, response, Problem("q", reference, {}))
    assert error is None and reward in (0.0, 1.0)
    if reference.strip() and response == f"Answer: {reference}" and reference in ("7", "-3", "0.5"):
        assert reward == 1.0


# ---------------------------------------------------------------- SIGINT / SIGTERM
def test_graceful_stop_first_signal_is_a_request_second_aborts_handlers_restored(capsys):
    from nearpolicy.signals import GracefulStop, StopRequested

    before = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        said = capsys.readouterr().err
        assert said.startswith("\nSIGTERM: stopping after the step in progress") and "again to abort" in said
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    assert StopRequested(signal.SIGINT, 3, Path("c/step_000003")).exit_code == 130
    assert str(StopRequested(signal.SIGTERM, 0, None)) == ("stopped by SIGTERM at step 0; no step completed, nothing "
                                                           "saved (run the same command again to start over)")


def test_ctrl_c_whose_keyboardinterrupt_a_finalizer_drops_still_stops_the_startup(monkeypatch):
    """A real SIGINT while start-up code runs a finalizer (tqdm.__del__ or a weakref callback as transformers'
    "Loading weights" bar ends): Python drops that KeyboardInterrupt ("Exception ignored in ..."). The start-up
    still ends with exit 130 and closes the trainer it built, instead of training on (seen in an arena)."""
    import nearpolicy.training.trainer
    from nearpolicy.training.run import build_trainer

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the finalizer

    class Built:
        closed = False

        def close(self):
            self.closed = True

    built, dropped = Built(), []

    def open_trainer(cfg, resume, log):
        Finalized()  # collected at once: its __del__ gets the Ctrl-C
        return built

    monkeypatch.setattr(nearpolicy.training.trainer, "open_trainer", open_trainer)
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in `nearpolicy`; an xdist worker has its own
    try:
        assert build_trainer(Config(), False, print) == (None, (130, "interrupted during startup; nothing was trained"))
        assert [issubclass(d.exc_type, KeyboardInterrupt) for d in dropped] == [True]  # the interpreter did drop it
        assert built.closed and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


@pytest.mark.parametrize("override, named", [("task.name=no_such_dataset", "no_such_dataset"),
                                             ("distill.teacher='/no/such/teacher.gguf'", "distill.teacher")])
def test_bad_task_or_teacher_fails_before_the_policy_loads(tmp_path, monkeypatch, override, named):
    import nearpolicy.model.load
    from nearpolicy.training.assemble import build_session

    def policy_must_not_load(*_a, **_k):
        raise AssertionError("the policy was loaded before the config was checked")

    monkeypatch.setattr(nearpolicy.model.load, "load_policy", policy_must_not_load)
    with pytest.raises(ValueError, match=named):
        build_session(load_config(None, [override]), tmp_path, print)


def _metrics_file(run: Path, text: str) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(text)
    return run


def test_metrics_reader_skips_only_a_cut_short_last_line_and_names_any_other_damage(tmp_path):
    """The one metrics.jsonl rule (runs.folder.read_metrics), shared by resume, summary, report and compare."""
    run = _metrics_file(tmp_path / "r", '{"step": 1, "a": 1.0}\n\n{"step": 0}\n{"step": 2, "a"')
    log = runs.read_metrics(run)
    assert [row["step"] for row in log.rows] == [0, 1]  # step order, blank line ignored
    assert log.warnings == [f"{run / 'metrics.jsonl'}: skipped line 4, cut short (not valid JSON)"]
    _metrics_file(run, '{"step": 0}\n{"step": 1, "a"\n\n  \n')  # blank lines after the cut-short one
    assert runs.read_metrics(run).warnings == [f"{run / 'metrics.jsonl'}: skipped line 2, cut short (not valid JSON)"]
    for text, said in [('{"step": 1}\nnot json\n{"step": 2}\n', "line 2 is not valid JSON"),
                       ('{"step": 1}\n{"step": "2"}\n', "line 2 is not a metrics object with an integer 'step'"),
                       ('{"step": true}\n', "line 1 is not a metrics object with an integer 'step'")]:
        _metrics_file(run, text)
        with pytest.raises(runs.RunFolderError, match=f"{run / 'metrics.jsonl'} {said}"):
            runs.read_metrics(run)
    with pytest.raises(runs.RunFolderError, match=f"no metrics.jsonl in {tmp_path / 'none'}"):
        runs.read_metrics(tmp_path / "none")


def test_resume_truncation_drops_later_rows_and_a_cut_short_line_and_refuses_damage(tmp_path):
    run = _metrics_file(tmp_path / "r", "".join(json.dumps({"step": s, "x": s / 2}) + "\n" for s in range(4))
                        + '{"step": 4, "x"')
    runs.truncate_metrics(run, 2)
    assert (run / "metrics.jsonl").read_text() == "".join(json.dumps({"step": s, "x": s / 2}) + "\n" for s in range(3))
    _metrics_file(run, '{"step": 0}\ngarbage\n{"step": 1}\n')
    with pytest.raises(runs.RunFolderError, match="line 2 is not valid JSON"):
        runs.truncate_metrics(run, 1)
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\ngarbage\n{"step": 1}\n'  # left as found


def test_summary_shares_the_reader_rule(tmp_path, capsys):
    from nearpolicy.cli import main

    run = _metrics_file(tmp_path / "r", '{"step": 0, "eval/accuracy": 0.5}\n{"step": 1, "reward/mean": 0.25}\n{"st')
    assert main(["summary", str(run)]) == 0
    captured = capsys.readouterr()
    assert "1 training steps" in captured.out and "| 0 | 0.500 |" in captured.out
    assert f"warning: {run / 'metrics.jsonl'}: skipped line 3, cut short" in captured.err
    _metrics_file(run, '{"step": 0}\nnot json\n{"step": 1}\n')
    assert main(["summary", str(run)]) == 2
    assert f"error: {run / 'metrics.jsonl'} line 2 is not valid JSON" in capsys.readouterr().err


def test_a_resume_that_changes_the_engine_precision_says_so():
    said = []
    resume.note_engine_precision({"engine_precision": "q8_0"}, "f16", said.append)
    resume.note_engine_precision({"engine_precision": "f16"}, "f16", said.append)
    resume.note_engine_precision({}, "f16", said.append)  # a checkpoint from before the record
    assert said == ["engine.precision changes on resume: q8_0 -> f16 (the weights are exported at f16 from now on; "
                    "expect a different engine/trainer mismatch)"]


def test_resume_is_refused_before_loading_when_metrics_are_damaged(tmp_path):
    run = _metrics_file(tmp_path / "r", '{"step": 0}\n{"step": 1, "x": nul}\n{"step": 2}\n')
    with pytest.raises(runs.RunFolderError, match="line 2 is not valid JSON"):
        resume.check_resume(run, Config(), {"kind": "reasoning_gym"}, [], [])
    _metrics_file(run, '{"step": 0}\n{"step": 1, "x": 0.5}\n{"step": 2, "x"')  # a kill's cut-short line: resumable
    resume.check_resume(run, Config(), {"kind": "reasoning_gym"}, [], [])


def test_resume_command_names_the_program_the_user_can_type(monkeypatch, tmp_path):
    from nearpolicy import signals

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(signals.shutil, "which", lambda name: None)
    monkeypatch.setattr(signals.sys, "argv", [str(tmp_path / ".venv/bin/nearpolicy"), "train"])
    assert signals.resume_command("runs/a") == ".venv/bin/nearpolicy train --resume runs/a"
    monkeypatch.setattr(signals.sys, "argv", ["/opt/np/bin/nearpolicy"])
    assert signals.resume_command("runs/a") == "/opt/np/bin/nearpolicy train --resume runs/a"
    monkeypatch.setattr(signals.shutil, "which", lambda name: "/opt/np/bin/nearpolicy")
    assert signals.resume_command("runs/a") == "nearpolicy train --resume runs/a"
    assert signals.resume_command("runs/my run") == "nearpolicy train --resume 'runs/my run'"
    monkeypatch.setattr(signals.sys, "argv", ["/other/bin/nearpolicy"])  # PATH's nearpolicy is another install
    assert signals.program_name() == "/other/bin/nearpolicy"
    monkeypatch.setattr(signals.sys, "argv", ["nearpolicy"])  # started from its own folder (pathlib drops ./)
    assert signals.program_name() == "./nearpolicy"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "np").symlink_to("/opt/np/bin/nearpolicy")  # a symlink of another name is kept
    monkeypatch.setattr(signals.sys, "argv", [str(tmp_path / "bin" / "np")])
    monkeypatch.setattr(signals.shutil, "which", lambda name: None)
    assert signals.program_name() == "bin/np"
    monkeypatch.setattr(signals.sys, "argv", ["/x/nearpolicy/__main__.py"])  # python -m nearpolicy
    monkeypatch.setattr(signals.sys, "executable", "/opt/np/bin/python3")
    assert signals.program_name() == "/opt/np/bin/python3 -m nearpolicy"
    monkeypatch.setattr(signals.shutil, "which", lambda name: "/opt/np/bin/nearpolicy")  # beside this interpreter
    assert signals.program_name() == "nearpolicy"
    monkeypatch.setattr(signals.sys, "executable", "/opt/py/bin/python3")  # PATH's is another environment's
    assert signals.resume_command("runs/a") == "/opt/py/bin/python3 -m nearpolicy train --resume runs/a"
    monkeypatch.setattr(signals.sys, "argv", ["/x/pytest/__main__.py"])  # another program's -m: the plain name
    assert signals.program_name() == "nearpolicy"


def test_a_run_warns_when_the_machine_is_busy_at_start():
    from nearpolicy.training.run import load_warning

    said = load_warning(5.0, 2)
    assert said.startswith("warning: 5.0 runnable processes (1-min load average) on 2 cores; the machine is busy")
    assert load_warning(0.9, 2) is None and load_warning(1.1, 2) is not None  # doctor's rule: above half the cores
    # the 1-min average lags: work that just ended (make train's pip install) is no load when nothing else runs now
    assert load_warning(1.9, 2, running_now=0) is None
    assert load_warning(1.9, 2, running_now=2).startswith("warning: 1.9 runnable processes (1-min load average), 2 "
                                                          "other tasks running now on 2 cores; the machine is busy")
