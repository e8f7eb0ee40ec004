"""Tool-use episodes through the real Trainer, in process, with nearpolicy's real MCP tool server: the tiny random
llama (conftest.py) on the fp32 hf engine, whose log-probs equal the trainer's, behind a wrapper that makes every
first turn a calculator call (its log-probs the engine's own, by teacher forcing); later turns are the model's.
With the observation tokens masked out at the right places, the per-turn mismatch is numerical noise in every turn;
a misaligned mask would put the tool's tokens, or shifted ones, against the engine's log-probs. The reward reads
only the last turn: the tool's answer (391) in the transcript earns nothing. The same on the asynchronous llama.cpp
replicas (rollout.engines = 1, partial rollouts): the replica process runs the episodes and their tool calls."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import pytest
import torch

from nearpolicy.config.schema import load_config
from nearpolicy.engines.llamacpp import EngineSpec
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

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int,
                 **interrupt) -> list[Rollout]:
        own = [r for r in requests if _tool_messages(r.prompt_ids) > 1]
        sampled = iter(self.engine.generate(own, sampling, seed, **interrupt) if own else [])
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


@dataclass(frozen=True)
class FirstTurnCallsSpec(EngineSpec):
    """An engine replica's EngineSpec whose engine is FirstTurnCalls over the llama.cpp engine (module-level: the
    replica process unpickles it)."""

    call_ids: tuple[int, ...] = ()

    def open(self):
        return FirstTurnCalls(super().open(), list(self.call_ids))


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


def _two_steps(model_path, tmp_path, extra: list[str] = (), replicas: bool = False):
    """Two Trainer steps + an eval of a tool-use run on the tiny model `model_path` (hf engine, the real tool
    server), the first turn of every episode scripted to call the calculator: (step rows, eval metrics, the call /
    observation ids). `replicas`: on one asynchronous f32 llama.cpp replica with partial rollouts, scripted the same
    way (FirstTurnCallsSpec), the tool server in the replica's process."""
    from nearpolicy.training import assemble as setup
    from nearpolicy.rollouts.episode_replicas import EpisodeReplicaRollouts
    from nearpolicy.training.trainer import open_trainer

    from nearpolicy.tools.protocol import ObservationFraming

    seen = {}

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = ToolAnswerTask(session.task)
        call_ids = seen["call"] = session.tokenizer.encode(CALL, add_special_tokens=False) + [2]
        seen["observation"] = ObservationFraming.from_template(session.tokenizer).observation_ids(
            session.tokenizer, "391", 2)
        engine = setup.build_engine(cfg, session)
        source = setup.build_rollouts(cfg, session, engine if replicas else FirstTurnCalls(engine, call_ids), log)
        if replicas:
            replica = source.spec_for
            source.spec_for = lambda path, version: FirstTurnCallsSpec(**asdict(replica(path, version)),
                                                                      call_ids=tuple(call_ids))
        return session, source

    engine = (["engine.precision=f32", "rollout.engines=1", "rollout.staleness=1", "rollout.partial=true",
               "rollout.engine_threads=1"] if replicas else ["engine.kind=hf"])
    cfg = load_config(None, [f"model.path='{model_path}'", f"run.output_dir='{tmp_path}'", "run.name=tools",
                             "run.steps=2", "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                             "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6", "task.eval_size=2",
                             "task.train_size=50", "logging.tensorboard=false", "logging.progress=false",
                             "model.max_context=512", "episode.enabled=true", "episode.max_turns=2",
                             "episode.max_tokens=100", "episode.turn_tokens=40", *engine, *extra])
    trainer = open_trainer(cfg, log=lambda _: None, build=build)
    try:
        assert isinstance(trainer.rollouts, EpisodeReplicaRollouts if replicas else EpisodeRollouts)
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
        assert row["rollout/decode_calls"] >= 1 and 0 < row["rollout/decode_occupancy"] <= 1  # both turns' calls
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
    from nearpolicy.model.load import load_policy

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


@pytest.mark.slow
def test_two_steps_of_tool_use_episodes_on_an_asynchronous_replica(tiny_gguf_factory, tmp_path):
    """rollout.engines = 1 with partial rollouts: the replica process runs every episode (its first turn scripted to
    call the calculator, nearpolicy's real tool server in the replica), the trainer trains the model's tokens of
    both turns within the staleness bound, and the eval runs greedy episodes in the trainer's process."""
    rows, evaluated, seen = _two_steps(tiny_gguf_factory("f32"), tmp_path, replicas=True)
    for step, row in enumerate(rows, start=1):
        assert row["policy/version"] == step and row["staleness/max"] <= 1
        assert row["episode/tool_calls_mean"] == 1 and row["episode/tool_errors"] == 0  # the replica's tool server
        assert row["turn0/episodes"] == 8 and row["turn1/episodes"] == 8
        assert row["turn0/tokens_mean"] == len(seen["call"])
        assert row["episode/observation_tokens_mean"] == len(seen["observation"])
        assert row["mismatch/tokens"] == 8 * (len(seen["call"]) + row["turn1/tokens_mean"])
        assert 0 <= row["mismatch/fresh_k3"] < 1e-5  # the f32 replica against the trainer: noise only
        assert row["reward/mean"] == 0.0 and math.isfinite(row["actor/loss"])
        if row["rollout/decode_calls"] > 0:  # the replica's calls whose results came in since the last step
            assert 0 < row["rollout/decode_occupancy"] <= 1
            assert row["rollout/decode_batch_mean"] == pytest.approx(64 * row["rollout/decode_occupancy"], rel=1e-12)
    assert rows[0]["rollout/decode_calls"] >= 1  # the second turns, sampled by the replica's llama.cpp engine
    assert rows[0]["staleness/off_policy_token_frac"] == 0  # step 1: every token fresh, so its k3 is the noise
    assert "eval/accuracy_no_tool" in evaluated and "eval/tool_calls_mean" in evaluated
