"""R-OPD's gradient-triggered curriculum (reconstructed from the abstract of the R-OPD paper): the trigger
(ops/ropd.py) against hand-computed statistics, the gradient probe (training/distillation.GradientProbe) against
per-micro-batch autograd, the switching source (rollouts/curriculum.py) with fake sources, and the real Trainer on
the tiny model: the switch fires, the samples then come from the initial policy, and --resume keeps it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nearpolicy.ops.ropd import gradient_plateau
from nearpolicy.rollouts.base import StepSamples
from nearpolicy.rollouts.curriculum import InitialPolicySwitch
from nearpolicy.training.distillation import GradientProbe

DT = torch.float64
# per-step micro-batch estimates [m = 2, d = 2] and their statistics by hand:
QUIET_0 = torch.tensor([[1.0, 0.0], [3.0, 0.0]], dtype=DT)  # mean (2, 0), SE^2 = (1 + 1) / (2 x 1) = 1
QUIET_1 = torch.tensor([[2.0, 1.0], [2.0, -1.0]], dtype=DT)  # mean (2, 0), SE^2 = 1: change 0 <= sqrt(1 + 1)
QUIET_2 = torch.tensor([[3.0, 0.0], [2.0, 0.0]], dtype=DT)  # mean (2.5, 0), SE^2 = 0.25: change 0.5 <= sqrt(1.25)
LOUD = torch.tensor([[10.0, 0.0], [10.0, 0.2]], dtype=DT)  # mean (10, 0.1), SE^2 = 0.01: change ~7.5 > 0.51


def _run(steps, z=1.0, patience=2):
    previous, se2, streak, out = None, None, 0, []
    for x in steps:
        check = gradient_plateau(x, previous, se2, streak, z, patience)
        previous, se2, streak = check.mean, check.se2, int(check.streak)
        out.append(check)
    return out


def test_the_statistics_by_hand():
    first, second, third = _run([QUIET_0, QUIET_1, QUIET_2])
    assert first.mean.tolist() == [2.0, 0.0] and first.se2.item() == 1.0
    assert math.isnan(first.change.item()) and math.isnan(first.noise.item())
    assert not first.quiet and int(first.streak) == 0 and not first.triggered  # no previous step: never quiet
    assert second.change.item() == 0.0 and second.noise.item() == pytest.approx(math.sqrt(2), rel=1e-15)
    assert second.quiet and int(second.streak) == 1 and not second.triggered  # the first quiet step does not fire
    assert third.se2.item() == 0.25 and third.change.item() == pytest.approx(0.5, rel=1e-15)
    assert third.noise.item() == pytest.approx(math.sqrt(1.25), rel=1e-15)
    assert third.quiet and int(third.streak) == 2 and third.triggered  # the second in a row does


def test_a_loud_step_resets_the_streak():
    checks = _run([QUIET_0, QUIET_1, LOUD, QUIET_0, QUIET_1, QUIET_2])
    assert [bool(c.quiet) for c in checks] == [False, True, False, False, True, True]
    assert [int(c.streak) for c in checks] == [0, 1, 0, 0, 1, 2]
    assert [bool(c.triggered) for c in checks] == [False, False, False, False, False, True]
    assert checks[2].change.item() == pytest.approx(math.hypot(8.0, 0.1), rel=1e-14)
    assert checks[2].noise.item() == pytest.approx(math.sqrt(0.01 + 1.0), rel=1e-14)
    assert checks[3].change.item() == pytest.approx(math.hypot(8.0, 0.1), rel=1e-14)  # back from (10, 0.1) to (2, 0)


def test_z_and_patience_scale_the_rule():
    strict = _run([QUIET_0, QUIET_1, QUIET_2], z=0.3)  # noise 0.3 sqrt(1.25) = 0.335 < 0.5 at the third step
    assert [bool(c.quiet) for c in strict] == [False, True, False]
    once = _run([QUIET_0, QUIET_1], patience=1)
    assert [bool(c.triggered) for c in once] == [False, True]


def test_non_finite_and_malformed_inputs():
    nan = gradient_plateau(torch.tensor([[float("nan"), 0.0], [1.0, 0.0]]), QUIET_0.mean(0), 1.0, 1)
    assert not nan.quiet and int(nan.streak) == 0
    zero = gradient_plateau(torch.zeros(2, 3), torch.zeros(3), 0.0, 1)  # no gradient seen: change 0, noise 0
    assert zero.change.item() == 0.0 and zero.noise.item() == 0.0 and not zero.quiet and int(zero.streak) == 0
    with pytest.raises(ValueError, match="m >= 2"):
        gradient_plateau(torch.zeros(1, 3), None, None, 0)
    with pytest.raises(ValueError, match="previous mean"):
        gradient_plateau(torch.zeros(2, 3), torch.zeros(4), 1.0, 0)
    with pytest.raises(ValueError, match="z > 0"):
        gradient_plateau(torch.zeros(2, 3), None, None, 0, z=0.0)


# -- the gradient probe ----------------------------------------------------------------------------------------------
def test_the_probe_gives_m_times_each_micro_batch_gradient():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, generator=g))
    b = torch.nn.Parameter(torch.randn(5, generator=g))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    a1, a2, c1 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(5, generator=g)
    probe = GradientProbe([w, frozen, b], size=100, seed=0)  # 17 coordinates <= 100: all of them, in order
    ((w * a1).sum() + (b * c1).sum()).backward()
    probe.record()
    ((w * a2).sum()).backward()  # b gets no gradient from the second micro-batch
    probe.record()
    x = probe.take()
    assert x.dtype == DT and x.shape == (2, 17)
    assert torch.allclose(x[0], 2 * torch.cat([a1.flatten(), c1]).double(), rtol=1e-6)
    assert torch.allclose(x[1], 2 * torch.cat([a2.flatten(), torch.zeros(5)]).double(), rtol=1e-6)
    assert probe.take().shape == (0, 17)  # take starts over
    small = GradientProbe([w, b], size=6, seed=3)
    assert sum(len(i) for _, i in small.index) == 6
    again = GradientProbe([w, b], size=6, seed=3)
    assert all(torch.equal(i, j) for (_, i), (_, j) in zip(small.index, again.index))  # the same coordinates
    full = torch.cat([w.grad.flatten(), b.grad]).double()
    flat = torch.cat([torch.zeros(0, dtype=torch.long)] + [i + (12 if p is b else 0) for p, i in small.index])
    assert torch.equal(small.read(), full[flat])


def test_the_probe_reads_the_first_mini_batch_of_policy_update(tiny_model_dir):
    import copy

    from nearpolicy.batching import collate
    from nearpolicy.model.load import load_policy
    from nearpolicy.model.policy import recompute_logprobs
    from nearpolicy.ops.corrections import CorrectionSpec
    from nearpolicy.ops.losses import PolicyLossParams
    from nearpolicy.training.distillation import UpdateDistill
    from nearpolicy.training.update import UpdateSettings, policy_update
    from nearpolicy.types import Rollout, SamplingParams

    model = load_policy(str(tiny_model_dir))[0]
    teacher = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(1.5)  # a sharper teacher: nonzero forward KL
    g = torch.Generator().manual_seed(1)
    rollouts = [Rollout(i, 0, torch.randint(3, 49152, (3,), generator=g).tolist(),
                        torch.randint(3, 49152, (5,), generator=g).tolist(), [-9.0] * 5, [0] * 5, "stop")
                for i in range(4)]
    batch, sampling = collate(rollouts, 2, 49152), SamplingParams(1.0, 1.0, 0, 8)
    probe = GradientProbe(model.parameters(), size=1 << 30)
    first_grads = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.step = lambda: first_grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    settings = UpdateSettings(2, 1, 1e9, "ppo_clip", PolicyLossParams(), "token-mean", None, CorrectionSpec())
    old = recompute_logprobs(model, batch, sampling, 4)[0]
    policy_update(model, optimizer, batch, old, torch.zeros(4), sampling, settings,
                  distill=UpdateDistill(teacher, 1.0, 0, probe))
    x = probe.take()
    assert x.shape[0] == 2  # mini-batch 1 of 2, micro-batches of one row: two estimates; mini-batch 2 unread
    assert torch.allclose(x.mean(0), first_grads[0], rtol=1e-5, atol=1e-9)  # their mean is the mini-batch gradient
    assert float((x[0] - x[1]).norm()) > 1e-3 * float(x[0].norm())


# -- the switching source ---------------------------------------------------------------------------------------------
class FakeSource:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def start(self, version, data_position, state):
        self.calls.append((self.name, "start", state))

    def collect(self, step, version, data_position):
        self.calls.append((self.name, "collect", step))
        return StepSamples([], {}, data_position + 1, {"source": self.name})

    def step_metrics(self, old_logprobs, rollout_logprobs, defined, versions, version):
        return {"inner/metric": 1.0}

    def publish(self, version):
        self.calls.append((self.name, "publish", version))

    def eval_engine(self):
        return self.name

    def evaluate(self, engine, problems, score):
        return [], [], {}

    def state_dict(self):
        return {"from": self.name}

    def close(self):
        self.calls.append((self.name, "close", None))


def _switch(estimates, calls, z=1.0):
    queue = list(estimates)
    return InitialPolicySwitch(FakeSource("inner", calls), lambda: queue.pop(0), lambda: FakeSource("initial", calls),
                               z, 2, log=calls.append)


def _step(source, step):
    got = source.collect(step, step, step)
    metrics = source.step_metrics(None, None, None, None, step)
    source.publish(step + 1)
    return got.metrics["source"], metrics


def test_the_source_switches_after_the_second_quiet_step_and_keeps_publishing_to_inner():
    calls = []
    source = _switch([QUIET_0, QUIET_1, QUIET_2, LOUD], calls)
    source.start(0, 0, None)
    taken = [_step(source, step) for step in range(4)]
    assert [name for name, _ in taken] == ["inner", "inner", "inner", "initial"]
    assert [m["distill/ropd_switched"] for _, m in taken] == [0.0, 0.0, 1.0, 1.0]
    assert [m["distill/ropd_streak"] for _, m in taken] == [0.0, 1.0, 2.0, 0.0]
    assert math.isnan(taken[0][1]["distill/ropd_grad_change"])
    assert taken[2][1]["distill/ropd_grad_change"] == pytest.approx(0.5) and taken[2][1]["inner/metric"] == 1.0
    assert taken[2][1]["distill/ropd_grad_noise"] == pytest.approx(math.sqrt(1.25))
    published = [c for c in calls if isinstance(c, tuple) and c[1] == "publish"]
    assert published == [("inner", "publish", v) for v in (1, 2, 3, 4)]
    assert source.eval_engine() == "inner"  # evaluations keep measuring the trained policy
    assert sum(isinstance(c, str) and c.startswith("R-OPD") for c in calls) == 1
    source.close()
    assert ("initial", "close", None) in calls and ("inner", "close", None) in calls


def test_the_state_survives_a_restart():
    calls = []
    source = _switch([QUIET_0, QUIET_1], calls)
    source.start(0, 0, None)
    _step(source, 0), _step(source, 1)
    state = json.loads(json.dumps(source.state_dict()))  # the checkpoint keeps it as JSON
    assert state["switched"] is False and state["streak"] == 1 and state["inner"] == {"from": "inner"}
    resumed = _switch([QUIET_2], calls)
    resumed.start(2, 2, state)
    assert ("inner", "start", {"from": "inner"}) in calls
    name, metrics = _step(resumed, 2)  # compared with the restored previous mean: quiet, second in a row -> switch
    assert name == "inner" and metrics["distill/ropd_switched"] == 1.0
    assert metrics["distill/ropd_grad_change"] == pytest.approx(0.5)
    switched = json.loads(json.dumps(resumed.state_dict()))
    again = _switch([LOUD], calls)
    again.start(3, 3, switched)
    assert again.switched and again.collect(3, 3, 3).metrics["source"] == "initial"  # a resume keeps the switch


# -- the real Trainer --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, smollm2_tokenizer):
    """Another random tiny llama (torch seed 7): the same tokenizer, a different distribution."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_CONFIG

    folder = tmp_path_factory.mktemp("tiny_teacher")
    torch.manual_seed(7)
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def _train(model_dir, teacher, out, steps, resume):
    from nearpolicy.config.schema import load_config
    from nearpolicy.training.trainer import open_trainer

    cfg = load_config(None, [f"model.path='{model_dir}'", f"distill.teacher='{teacher}'", f"run.output_dir='{out}'",
                             "run.name=ropd", f"run.steps={steps}", "run.threads=1", "engine.kind=hf",
                             "distill.divergence=forward", "distill.ropd=true", "distill.ropd_z=1e6",
                             "algorithm.loss=importance_sampling", "algorithm.lr=1e-2", "algorithm.prompts_per_step=2",
                             "algorithm.group_size=4", "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6",
                             "task.eval_size=2", "task.train_size=50", "logging.eval_every=100",
                             "logging.tensorboard=false", "logging.progress=false", "model.max_context=256"])
    trainer = open_trainer(cfg, resume=resume, log=lambda _: None)
    trainer.fit(progress=False)
    rows = [json.loads(line) for line in (out / "ropd" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "distill/ropd_switched" in row}


def test_the_trainer_switches_to_the_initial_policy_and_a_resume_keeps_it(tiny_model_dir, teacher_dir, tmp_path):
    """z = 1e6: every step after the first is quiet, so the trigger fires at step 3 (the second quiet step), across
    a resume after step 2 (the streak and the previous mean come from the checkpoint). Before the switch the hf
    engine holds the trainer's weights (mismatch k1 ~ 0); after it the samples are the initial policy's, which the
    trainer (lr 1e-2, moved for 3 steps) no longer is."""
    first = _train(tiny_model_dir, teacher_dir, tmp_path, 2, resume=False)
    rows = first | _train(tiny_model_dir, teacher_dir, tmp_path, 4, resume=True)
    assert [rows[s]["distill/ropd_switched"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert [rows[s]["distill/ropd_streak"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 3.0]
    assert rows[1]["distill/ropd_grad_change"] is None and rows[3]["distill/ropd_grad_change"] > 0  # NaN: null
    assert all(rows[s]["distill/forward_kl"] > 0.1 for s in (1, 2, 3, 4))
    assert all(abs(rows[s]["mismatch/k1"]) < 1e-4 for s in (1, 2, 3))  # the student's own samples
    assert abs(rows[4]["mismatch/k1"]) > 1e-2  # the initial policy's samples
    resumed = _train(tiny_model_dir, teacher_dir, tmp_path, 5, resume=True)
    assert resumed[5]["distill/ropd_switched"] == 1.0 and abs(resumed[5]["mismatch/k1"]) > 1e-2


def test_config_refuses_a_switch_it_cannot_make():
    from nearpolicy.config.schema import ConfigError, load_config

    base = ["distill.teacher=smollm2", "distill.divergence=forward", "distill.ropd=true"]
    cfg = load_config(None, base)  # 32 samples, micro-batches of 8: four estimates per step
    assert (cfg.distill.ropd, cfg.distill.ropd_z, cfg.distill.ropd_patience) == (True, 1.0, 2)
    assert not load_config(None, []).distill.ropd
    cases = [(base[:1] + ["distill.ropd=true"], r"distill\.divergence = .forward."),
             (["distill.ropd=true"], r"distill\.teacher"),
             (base + ["algorithm.micro_batch_size=32"], r"algorithm\.micro_batch_size"),
             (base + ["rollout.engines=2", "rollout.staleness=1"], r"rollout\.engines"),
             (base + ["episode.enabled=true"], r"episode\.enabled")]
    for sets, named in cases:
        with pytest.raises(ConfigError, match=named):
            load_config(None, sets)
