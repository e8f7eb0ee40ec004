"""Tool-use episodes on the asynchronous replicas (rollouts/worker.run_episodes + the scheduler), token-in/token-out
across a weight update (invariants 10 and 19): an episode interrupted mid-turn by an update and resumed with partial
rollouts keeps a mask as long as its ids, its model tokens carry the versions of the segments that sampled them
and those versions' log-probs, its observations are masked out, and the trained ids are the sampled ids; a turn cut
by the update is one turn. With partial rollouts off it restarts from its prompt; an episode older than the
staleness bound is dropped and sampled again; a tool server that dies inside a replica is an error observation.
A scripted engine controls what the model "writes" and when the update lands; its log-probs are known numbers."""

from __future__ import annotations

import ast
import json
import sys
from types import SimpleNamespace

import pytest

from nearpolicy.batching import collate
from nearpolicy.rollouts.episode_state import Episode
from nearpolicy.rollouts.episodes import EpisodeSetup, EpisodeLimits
from nearpolicy.rollouts.scheduler import RolloutScheduler, staleness_metrics
from nearpolicy.rollouts.service import RolloutService
from nearpolicy.rollouts.worker import EngineWorker
from nearpolicy.tools.client import Observation
from nearpolicy.types import Rollout, SamplingParams
from test_episodes import STOP, _call, _encode, _runner, _three_turns, framing, prompt, tok  # noqa: F401 - fixtures
from test_tools import CRASHY

ASSISTANT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n": every turn starts after it
SAMPLING = SamplingParams(1.0, 1.0, 0, 32)
VOCAB, PAD = 49152, 2


def logprob(position: int, version: int) -> float:
    """What the scripted engine reports for the id at `position` of the whole sequence under weights `version`."""
    return -0.01 * position - 0.1 - version / 100


class ScriptedReplica:
    """A replica's engine that writes turn k (k = tool messages in the prompt) of `script`, continuing a turn the
    prompt already holds part of; it samples one id of every sequence per decode step and polls `interrupt` before
    each step as llama.cpp does. `cut` (call number, step): the weight update lands before that step of that
    generate call. Records every request and what it returned."""

    def __init__(self, script: list[list[int]], cut: tuple[int, int] | None = None):
        self.script, self.cut, self.version, self.calls, self.requests = script, cut, 0, 0, []
        self.step = 0

    def interrupted(self) -> bool:
        return self.cut is not None and (self.calls, self.step) >= self.cut and self.calls == self.cut[0]

    def _rest(self, prompt: tuple[int, ...]) -> list[int]:
        p = list(prompt)
        starts = [i + len(ASSISTANT) for i in range(len(p)) if p[i : i + len(ASSISTANT)] == ASSISTANT]
        turn = sum(p[i : i + 3] == [1, 19324, 198] for i in range(len(p)))  # <|im_start|>tool\n
        return self.script[min(turn, len(self.script) - 1)][len(p) - starts[-1]:]

    def generate(self, requests, sampling, seed, interrupt=None):
        self.calls += 1
        wanted = [self._rest(r.prompt_ids)[: r.token_limit(sampling.max_new_tokens)] for r in requests]
        got: list[list[int]] = [[] for _ in requests]
        for self.step in range(max(map(len, wanted), default=0) + 1):
            if interrupt is not None and interrupt():
                break
            for ids, want in zip(got, wanted):
                if len(ids) < len(want):
                    ids.append(want[len(ids)])
        out = []
        for r, ids, want in zip(requests, got, wanted):
            finish = "interrupted" if len(ids) < len(want) else "stop" if ids and ids[-1] in STOP else "length"
            lps = [logprob(len(r.prompt_ids) + t, self.version) for t in range(len(ids))]
            out.append(Rollout(r.group_id, 0, list(r.prompt_ids), ids, lps, [self.version] * len(ids), finish))
        self.requests += list(zip(requests, out))
        return out

    def update_weights(self, path, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


class Calculator:
    """A ToolClient stand-in that evaluates the expression (+ and * of integers)."""

    def call(self, name, arguments):
        return Observation(str(eval(compile(ast.parse(arguments["expression"], mode="eval"), "", "eval"))))

    def close(self):
        pass


def _replica(engine, runner) -> EngineWorker:
    return EngineWorker(SimpleNamespace(open=lambda: engine), SimpleNamespace(runner=lambda: runner))


def _segment(worker, sched, service, seed: int, interrupt=None, limit: int = 2) -> None:
    jobs = [service._job(s) for s in sched.next_segments(limit=limit)]
    for result in worker.run(jobs, SAMPLING, seed, interrupt):
        sched.on_result(result)


def _start(tok, framing, prompt, partial: bool, cut):
    """Group 0 (2 episodes of the three-turn script) on a scripted replica, its first segment at version 0 cut by
    the update at `cut`; the update then lands (version 1). (scheduler, service, worker, engine, script)."""
    script = _three_turns(tok)
    engine = ScriptedReplica(script, cut)
    worker = _replica(engine, _runner(tok, framing, Calculator()))
    sched = RolloutScheduler(2, 1, 1, 400, partial=partial)
    service = RolloutService(sched, SimpleNamespace(replicas=1), lambda g: tuple(prompt), SAMPLING, 0, 16, "-")
    _segment(worker, sched, service, 1, engine.interrupted)
    sched.publish(1)
    worker.load("v1.gguf", 1)
    return sched, service, worker, engine, script


def test_an_episode_cut_mid_turn_by_an_update_resumes_with_its_masks_versions_and_sampled_ids(tok, framing, prompt):
    sched, service, worker, engine, script = _start(tok, framing, prompt, True, cut=(2, 5))  # 5 ids into turn 1
    cut = sched.sample(0, 0).episode
    assert (cut.turns, cut.open_turn, cut.done) == (1, 5, False) and cut.tool_calls == 1
    assert Episode.from_dict(json.loads(json.dumps(cut.to_dict()))) == cut  # a checkpoint's JSON keeps the open turn
    _segment(worker, sched, service, 2)
    (group,) = sched.take_batch()
    observations = [framing.observation_ids(tok, text, 2) for text in ("391", "400")]
    before = len(script[0]) + len(observations[0]) + 5  # the ids sampled with version 0
    rollouts = []
    for s in group.samples:
        r = s.episode.to_rollout(STOP)
        n = len(r.completion_ids)
        assert len(r.model_mask) == len(r.turn_index) == len(r.versions) == len(r.rollout_logprobs) == n
        assert r.versions == [0] * before + [1] * (n - before) == s.versions
        assert r.completion_ids == s.completion_ids and r.rollout_logprobs == s.logprobs
        assert r.completion_ids == script[0] + observations[0] + script[1] + observations[1] + script[2]
        assert r.turn_index == [0] * (len(script[0]) + len(observations[0])) + \
            [1] * (len(script[1]) + len(observations[1])) + [2] * len(script[2])  # the cut turn is one turn
        for k, (own, lp, v) in enumerate(zip(r.model_mask, r.rollout_logprobs, r.versions)):
            assert lp == (pytest.approx(logprob(len(prompt) + k, v), abs=1e-12) if own else None)
        assert r.extras["episode"] == {"turns": 3, "tool_calls": 2, "tool_errors": {}, "end": "answer"}
        rollouts.append(r)
    resumed = [req for req, _ in engine.requests[4:6]]  # the second segment's first turn: the rest of turn 1
    assert all(req.prompt_ids == tuple(prompt) + tuple(script[0] + observations[0] + script[1][:5]) for req in resumed)
    assert [req.max_new_tokens for req in resumed] == [120 - 5] * 2  # the rest of the cut turn's token limit
    batch = collate(rollouts, PAD, VOCAB)
    sampled = [t for _, out in engine.requests for t in out.completion_ids]  # every id the engine returned
    assert sorted(batch.completion_ids[batch.mask].tolist()) == sorted(sampled)
    for row in range(2):  # the trained ids are the sampled ids; the observations are out of the loss
        assert batch.completion_ids[row][batch.mask[row]].tolist() == script[0] + script[1] + script[2]
        assert batch.completion_ids[row][batch.observation_mask[row]].tolist() == observations[0] + observations[1]
    assert not batch.has_rollout[batch.observation_mask].any() and batch.versions[0].tolist() == rollouts[0].versions
    metrics = staleness_metrics([group], 1)
    assert metrics["staleness/max"] == 1 and metrics["staleness/mixed_version_sample_frac"] == 1
    assert sched.stats["restarted_samples"] == 0


def test_an_episode_cut_between_turns_continues_with_its_next_turn(tok, framing, prompt):
    sched, service, worker, engine, script = _start(tok, framing, prompt, True, cut=(2, 0))  # before turn 1 begins
    cut = sched.sample(0, 1).episode
    assert (cut.turns, cut.open_turn, len(cut.ids)) == (1, 0, len(script[0]) + len(framing.observation_ids(tok, "391", 2)))
    _segment(worker, sched, service, 2)
    (group,) = sched.take_batch()
    for s in group.samples:
        assert s.episode.end == "answer" and s.versions == [0] * len(cut.ids) + [1] * (len(s.versions) - len(cut.ids))


def test_with_partial_rollouts_off_an_interrupted_episode_restarts_from_its_prompt(tok, framing, prompt):
    sched, service, worker, engine, script = _start(tok, framing, prompt, False, cut=(2, 5))
    assert sched.stats["restarted_samples"] == 2
    assert all(sched.sample(0, i).episode is None and sched.sample(0, i).completion_ids == [] for i in range(2))
    _segment(worker, sched, service, 2)
    (group,) = sched.take_batch()
    for s in group.samples:
        assert s.versions == [1] * len(s.completion_ids) and s.episode.turns == 3  # one version per sample
        assert s.episode.to_rollout(STOP).completion_ids[: len(script[0])] == script[0]


def test_an_episode_older_than_the_staleness_bound_is_sampled_again(tok, framing, prompt):
    sched, service, worker, engine, script = _start(tok, framing, prompt, True, cut=(2, 5))
    sched.publish(2)  # a second update before the episode goes on: its version-0 tokens lag 2 > eta = 1
    worker.load("v2.gguf", 2)
    _segment(worker, sched, service, 2)
    assert sched.take_batch() is None and sched.stats["dropped_stale_groups"] == 1
    assert sched.sample(0, 0).episode is None  # dropped: from scratch
    _segment(worker, sched, service, 3)
    (group,) = sched.take_batch()
    assert all(s.versions == [2] * len(s.completion_ids) and s.episode.end == "answer" for s in group.samples)


def test_an_episode_that_disagrees_with_its_sample_is_refused(tok, framing, prompt):
    sched, service, worker, engine, script = _start(tok, framing, prompt, True, cut=(2, 5))
    (job,) = [service._job(s) for s in sched.next_segments(limit=1)]
    result = worker.run([job], SAMPLING, 2)[0]
    result.episode.versions[0] = 7
    with pytest.raises(ValueError, match="disagrees with the sample's tokens"):
        sched.on_result(result)


def test_a_tool_server_that_dies_inside_a_replica_is_an_error_observation(tok, framing, prompt, tmp_path):
    server = tmp_path / "crashy.py"
    server.write_text(CRASHY)
    script = [_encode(tok, _call("crash")) + [2], _encode(tok, _call("echo", text="back again")) + [2],
              _encode(tok, "Answer: 1") + [2]]
    setup = EpisodeSetup(tok, framing, STOP, EpisodeLimits(3, 400, 120), (sys.executable, str(server)), 10.0)
    worker = EngineWorker(SimpleNamespace(open=lambda: ScriptedReplica(script)), setup)  # its own ToolClient
    sched = RolloutScheduler(1, 1, 0, 400)
    service = RolloutService(sched, SimpleNamespace(replicas=1), lambda g: tuple(prompt), SAMPLING, 0, 16, "-")
    try:
        _segment(worker, sched, service, 1)
    finally:
        worker.close()
    (group,) = sched.take_batch()
    episode = group.samples[0].episode
    assert episode.end == "answer" and episode.turns == 3 and episode.tool_errors == {"server_died": 1}
    shown = tok.decode([t for t, own in zip(episode.ids, episode.model_mask) if not own], skip_special_tokens=True)
    assert "error: the tool server failed" in shown and "back again" in shown  # a new server answered the next call


def test_episodes_on_the_replicas_are_accepted_and_vllm_is_still_refused():
    from nearpolicy.config.schema import ConfigError, load_config

    cfg = load_config(None, ["episode.enabled=true", "rollout.engines=1", "rollout.staleness=1", "rollout.partial=true"])
    assert cfg.episode.enabled and cfg.rollout.engines == 1 and cfg.rollout.partial
    with pytest.raises(ConfigError, match="not supported with engine.kind = 'vllm'"):
        load_config(None, ["episode.enabled=true", "engine.kind=vllm"])


def test_staleness_metrics_count_only_an_episodes_trained_tokens():
    from nearpolicy.rollouts.episode_state import Episode
    from nearpolicy.rollouts.scheduler import GroupState, SampleState, staleness_metrics

    # 2 model ids at v0, 3 observation ids at v0, 1 model id at v1: trained lags at v1 are [1, 1, 0]
    episode = Episode(0, 0, [5], 10, [1, 2, 7, 8, 9, 3], [-0.1, -0.2, None, None, None, -0.3], [0, 0, 0, 0, 0, 1],
                      [True, True, False, False, False, True], [0, 0, 0, 0, 0, 1], 1)
    sample = SampleState(list(episode.ids), list(episode.logprobs), list(episode.versions), "stop", episode)
    out = staleness_metrics([GroupState(0, [sample])], version=1)
    assert out["staleness/tokens_lag_1"] == pytest.approx(2 / 3) and out["staleness/tokens_lag_0"] == pytest.approx(1 / 3)
    assert out["staleness/mean"] == pytest.approx(2 / 3) and out["staleness/off_policy_token_frac"] == pytest.approx(2 / 3)
    plain = SampleState(list(episode.ids), list(episode.logprobs), list(episode.versions), "stop")
    assert staleness_metrics([GroupState(0, [plain])], 1)["staleness/tokens_lag_1"] == pytest.approx(5 / 6)
