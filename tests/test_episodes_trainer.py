"""Tool-use episodes through the real Trainer, in process, with nearpolicy's real MCP tool server: the tiny random
llama (conftest.py) on the fp32 hf engine, whose log-probs equal the trainer's, behind a wrapper that makes every
first turn a calculator call (its log-probs the engine's own, by teacher forcing); later turns are the model's.
With the observation tokens masked out at the right places, the per-turn mismatch is numerical noise in every turn;
a misaligned mask would put the tool's tokens, or shifted ones, against the engine's log-probs. The reward reads
only the last turn: the tool's answer (391) in the transcript earns nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nearpolicy.config import load_config
from nearpolicy.rollouts.episodes import EpisodeRollouts
from nearpolicy.tasks.base import Problem
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

TOOL_HEADER = [1, 19324, 198]  # "<|im_start|>tool\n" (the example's tool message is in every prompt once)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'


def _tool_messages(prompt) -> int:
    p = list(prompt)
    return sum(p[i : i + 3] == TOOL_HEADER for i in range(len(p) - 2))


class FirstTurnCalls:
    """`engine` whose first turn of every episode (a prompt with only the worked example's tool message) is CALL +
    <|im_end|>, reported with the engine's own log-probs of those ids (score); every other turn is the engine's."""

    def __init__(self, engine, call_ids: list[int]):
        self.engine, self.call_ids = engine, call_ids

    @property
    def version(self):
        return self.engine.version

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        own = [r for r in requests if _tool_messages(r.prompt_ids) > 1]
        sampled = iter(self.engine.generate(own, sampling, seed) if own else [])
        out = []
        for r in requests:
            if _tool_messages(r.prompt_ids) > 1:
                out.append(next(sampled))
                continue
            ids = self.call_ids[: r.token_limit(sampling.max_new_tokens)]
            lps = self.engine.score(list(r.prompt_ids), ids, sampling)
            out.append(Rollout(r.group_id, 0, list(r.prompt_ids), ids, lps, [self.version] * len(ids), "stop"))
        return out

    def greedy(self, prompts, max_new_tokens):
        own = [p for p in prompts if _tool_messages(p) > 1]
        answers = iter(self.engine.greedy(own, max_new_tokens) if own else [])
        return [next(answers) if _tool_messages(p) > 1 else self.call_ids[:max_new_tokens] for p in prompts]

    def __getattr__(self, name):
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


class ToolAnswerTask:
    """The run's task, scored 1 when the response holds the tool's answer 391 (module-level: the scoring process
    unpickles it)."""

    def __init__(self, task):
        self.task = task

    def score(self, response: str, problem: Problem) -> float:
        return float("391" in response)

    def __getattr__(self, name):
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


@pytest.mark.slow
def _two_steps(tiny_model_dir, tmp_path, extra: list[str] = ()):
    """Two Trainer steps + an eval of a tool-use run on the tiny model (hf engine, the real tool server), the first
    turn of every episode scripted to call the calculator: (step rows, eval metrics, the call / observation ids)."""
    from nearpolicy import setup
    from nearpolicy.trainer import open_trainer

    from nearpolicy.tools.protocol import ObservationFraming

    seen = {}

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = ToolAnswerTask(session.task)
        call_ids = seen["call"] = session.tokenizer.encode(CALL, add_special_tokens=False) + [2]
        seen["observation"] = ObservationFraming.from_template(session.tokenizer).observation_ids(
            session.tokenizer, "391", 2)
        engine = FirstTurnCalls(setup.build_engine(cfg, session), call_ids)
        return session, setup.build_rollouts(cfg, session, engine, log)

    cfg = load_config(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "run.name=tools",
                             "run.steps=2", "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                             "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6", "task.eval_size=2",
                             "task.train_size=50", "logging.tensorboard=false", "logging.progress=false",
                             "model.max_context=512", "engine.kind=hf", "episode.enabled=true", "episode.max_turns=2",
                             "episode.max_tokens=100", "episode.turn_tokens=40", *extra])
    trainer = open_trainer(cfg, log=lambda _: None, build=build)
    try:
        assert isinstance(trainer.rollouts, EpisodeRollouts)
        rows = []
        for _ in range(2):
            rows.append(trainer.train_step())
            trainer.state.step += 1
        evaluated = trainer.evaluate()
    finally:
        trainer.close()
    return rows, evaluated, seen


def test_a_two_step_tool_use_run_trains_on_the_models_tokens_with_the_real_tool_server(tiny_model_dir, tmp_path):
    rows, evaluated, seen = _two_steps(tiny_model_dir, tmp_path)
    for row in rows:
        assert row["episode/tool_calls_mean"] >= 1 and row["episode/tool_errors"] == 0
        assert row["turn0/episodes"] == 8 and row["turn1/episodes"] == 8 and row["episode/turns_mean"] == 2
        assert row["turn0/tokens_mean"] == len(seen["call"])  # the call's tokens and <|im_end|>
        assert row["episode/observation_tokens_mean"] == len(seen["observation"]) == 13  # \n<|im_start|>tool\n 3 9 1 ...
        for k in (0, 1):  # the fp32 engine against the trainer: noise only, in both turns
            assert 0 <= row[f"mismatch/k3_turn{k}"] < 1e-5, k
        assert row["mismatch/tokens"] == 8 * (len(seen["call"]) + row["turn1/tokens_mean"])
        assert row["reward/mean"] == 0.0  # 391 stood only in the tool's answer, which the reward never reads
        assert math.isfinite(row["actor/loss"]) and row["policy/version"] >= 1
    assert evaluated["eval/tool_calls_mean"] == 1 and evaluated["eval/well_formed_calls"] == 1
    assert evaluated["eval/accuracy"] == 0 and "eval/accuracy_no_tool" in evaluated
    samples = [json.loads(line) for line in (tmp_path / "tools" / "samples.jsonl").read_text().splitlines()]
    assert "tool\n391\nassistant" in samples[-1]["response"]  # the eval episode's transcript, observation included


def test_step_metrics_give_the_k3_of_each_turn_from_the_last_collect():
    source = EpisodeRollouts.__new__(EpisodeRollouts)
    source._turns = [[0, 0, 0, 1, 1], [0, 0]]
    old = torch.tensor([[-1.0, -2.0, -1.0, -0.5, -3.0], [-1.0, -1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.1, -2.0, math.nan, -0.3, -3.0], [-0.8, -1.0, math.nan, math.nan, math.nan]],
                           dtype=torch.float64)
    defined = torch.tensor([[True, True, False, True, True], [True, True, False, False, False]])
    got = source.step_metrics(old, rollout, defined, torch.zeros(2, 5, dtype=torch.long), 0)
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731 - d = log pi_old - log mu
    assert got["mismatch/k3_turn0"] == pytest.approx((k3(0.1) + k3(0.0) + k3(-0.2) + k3(0.0)) / 4, rel=1e-9)
    assert got["mismatch/k3_turn1"] == pytest.approx((k3(-0.2) + k3(0.0)) / 2, rel=1e-9)
    with pytest.raises(ValueError, match="3 rows for the 2 episodes"):
        source.step_metrics(torch.zeros(3, 5), torch.zeros(3, 5), torch.ones(3, 5, dtype=torch.bool), None, 0)


def test_the_hf_engine_honours_each_requests_own_token_limit(tiny_model_dir):
    from nearpolicy.engines.hf import HFEngine
    from nearpolicy.models import load_policy

    engine = HFEngine(load_policy(str(tiny_model_dir))[0], {0, 2, 4})
    requests = [GenerationRequest(0, (1, 50, 60), 1, max_new_tokens=3), GenerationRequest(1, (1, 70), 1)]
    out = engine.generate(requests, SamplingParams(max_new_tokens=9), seed=0)
    for rollout, limit in zip(out, (3, 9)):  # a sample that did not stop ran exactly to its own limit
        assert len(rollout.completion_ids) == limit or rollout.finish_reason == "stop"
        assert len(rollout.completion_ids) <= limit



@pytest.mark.slow
@pytest.mark.parametrize("credit", ["trace", "rtpo"])
def test_turn_credit_and_the_observation_loss_run_in_the_trainer(tiny_model_dir, tmp_path, credit):
    """algorithm.turn_credit gives token advantages over the episodes (trace: the frozen reference model scores the
    gold answer at each boundary) and observation_loss_coef adds ECHO's loss: both reach the step's metrics."""
    rows, _, _ = _two_steps(tiny_model_dir, tmp_path, [f"algorithm.turn_credit={credit}",
                                                       "algorithm.observation_loss_coef=0.2"])
    for row in rows:
        assert row["actor/observation_loss"] > 5  # the tiny random model: about log V per observation token
        assert math.isfinite(row["actor/loss"]) and row["turn1/episodes"] == 8
        assert any(key.startswith("turn_credit/") for key in row), sorted(row)
