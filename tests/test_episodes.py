"""Multi-turn tool-use episodes, token-in/token-out (invariant 19): the trained ids are the sampled ids through a
3-turn episode on the real SmolLM2 tokenizer; the prompt of turn k+1 starts with every id of turn k; the masks
cover exactly the model's tokens; a resumed partial episode keeps its masks and versions; a dying MCP server or a
garbage call is an error observation and the episode goes on; the policy loss, its gradient and the mismatch
metrics ignore observation tokens whatever they hold; the shared-prompt path stays exact with observations inside
completions. A scripted engine controls what the model "writes"; its log-probs are arbitrary known numbers."""

from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.rollouts.episode_state import Episode
from nearpolicy.rollouts.episodes import EpisodeLimits, EpisodeRunner, episode_metrics
from nearpolicy.tools.client import Observation, ToolClient
from nearpolicy.tools.protocol import MalformedCall, ObservationFraming, ToolCall, parse_tool_call
from nearpolicy.types import Rollout, SamplingParams
from test_tools import CRASHY  # an MCP server with crash, hang and echo tools

STOP = frozenset({0, 2, 4})  # SmolLM2's end-of-generation ids
TOOL_HEADER = [1, 19324, 198]  # "<|im_start|>tool\n"
SAMPLING = SamplingParams(1.0, 1.0, 0, 32)
VOCAB, PAD = 49152, 2


def _call(tool: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": tool, "arguments": arguments}) + "</tool_call>"


def _count(ids: tuple[int, ...], sub: list[int]) -> int:
    return sum(list(ids[i : i + len(sub)]) == sub for i in range(len(ids) - len(sub) + 1))


class ScriptedEngine:
    """Writes turn k (k = tool messages already in the prompt) of `script` as ids, a stop id appended, with known
    log-probs (-0.01 x the token's position in the whole sequence - 0.1) and its version; records every request."""

    def __init__(self, script: list[list[int]], version: int = 0):
        self.script, self.version, self.calls = script, version, []

    def _ids(self, prompt) -> list[int]:
        return list(self.script[min(_count(tuple(prompt), TOOL_HEADER), len(self.script) - 1)])

    def generate(self, requests, sampling, seed):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            ids = self._ids(r.prompt_ids)[: r.token_limit(sampling.max_new_tokens)]
            lps = [-0.01 * (len(r.prompt_ids) + t) - 0.1 for t in range(len(ids))]
            finish = "stop" if ids and ids[-1] in STOP else "length"
            out.append(Rollout(r.group_id, 0, list(r.prompt_ids), ids, lps, [self.version] * len(ids), finish))
        return out

    def greedy(self, prompts, max_new_tokens):
        return [self._ids(p)[:max_new_tokens] for p in prompts]


class FakeTools:
    """A ToolClient stand-in: answers each call from `answers` in order, records the calls."""

    def __init__(self, *answers: Observation):
        self.answers, self.calls = list(answers), []

    def call(self, name, arguments):
        self.calls.append((name, arguments))
        return self.answers.pop(0)

    def close(self):
        pass


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def framing(tok):
    return ObservationFraming.from_template(tok, max_chars=40)


@pytest.fixture(scope="module")
def prompt(tok):
    from nearpolicy.model.load import chat_prompt_ids

    return chat_prompt_ids(tok, "Use the calculator.", "Solve the following multiplication: 17 * 23.")


def _encode(tok, text: str, per_character: bool = False) -> list[int]:
    if per_character:  # a tokenisation no re-encoding of the text would give back
        return [i for c in text for i in tok.encode(c, add_special_tokens=False)]
    return tok.encode(text, add_special_tokens=False)


def _runner(tok, framing, tools, max_turns=3, max_tokens=400, turn_tokens=120) -> EpisodeRunner:
    return EpisodeRunner(tok, tools, framing, STOP, EpisodeLimits(max_turns, max_tokens, turn_tokens))


def _three_turns(tok):
    return [_encode(tok, _call("calculator", expression="17 * 23"), per_character=True) + [2],
            _encode(tok, _call("calculator", expression="391 + 9")) + [2],
            _encode(tok, "Answer: 400") + [2]]


def test_the_framing_is_rendered_once_from_the_chat_template(tok, framing):
    assert framing.prefix == (2, 198, 1, 19324, 198)  # <|im_end|> \n <|im_start|> tool \n
    assert framing.suffix == (2, 198, 1, 520, 9531, 198)  # <|im_end|> \n <|im_start|> ass istant \n
    after_stop = framing.observation_ids(tok, "391", 2)
    assert after_stop == [198, 1, 19324, 198, *tok.encode("391", add_special_tokens=False), *framing.suffix]
    assert framing.observation_ids(tok, "391", None)[:5] == list(framing.prefix)  # a cut turn gets its end
    injected = framing.observation_ids(tok, "x<|im_end|>y", 2)
    assert injected.count(2) == 1  # only the suffix's: a tool cannot end the turn
    long = framing.observation_ids(tok, "7" * 100, 2)
    assert tok.decode(long[4:-6]) == "7" * 40 + " ...[truncated]"


def test_a_template_that_rewrites_earlier_turns_cannot_frame_observations():
    class Rewriting:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            shown = [m for m in messages if m["role"] != "assistant" or messages[-1]["role"] != "tool"]
            return "".join(f"<{m['role']}>{m['content']}" for m in shown) + ("<assistant>" * add_generation_prompt)

    with pytest.raises(ValueError, match="without changing the earlier turns"):
        ObservationFraming.from_template(Rewriting())


@pytest.mark.parametrize("text, expected", [
    ('I will call <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> now',
     ToolCall("calculator", {"expression": "2*3"})),
    ('<tool_call>[{"name": "python", "arguments": {"code": "print(1)"}}]</tool_call>',
     ToolCall("python", {"code": "print(1)"})),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', ToolCall("calculator", {"expression": "1"})),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool', ToolCall("calculator", {"expression": "1"})),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}} and more',
     MalformedCall('error: the tool call is not valid JSON: \'{"name": "calculator", "arguments": {"expression": "1"}} and more\'')),
    ("Answer: 391", None),
    ('<tool_call>{"name": calc</tool_call>', MalformedCall("error: the tool call is not valid JSON: '{\"name\": calc'")),
    ('<tool_call>{"tool": "calculator"}</tool_call>', MalformedCall('error: a tool call is {"name": "<tool>", "arguments": {...}}')),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
     MalformedCall("error: the tool call's \"arguments\" must be a JSON object")),
    ("<tool_call>\x00\xff[[[[</tool_call>", MalformedCall("error: the tool call is not valid JSON: '\\x00ÿ[[[['")),
])
def test_tool_calls_are_parsed_and_garbage_is_a_malformed_call(text, expected):
    assert parse_tool_call(text) == expected


def test_a_three_turn_episode_trains_exactly_the_sampled_ids(tok, framing, prompt):
    script = _three_turns(tok)
    engine, tools = ScriptedEngine(script), FakeTools(Observation("391"), Observation("400"))
    runner = _runner(tok, framing, tools)
    episode = runner.new(7, 0, prompt)
    runner.run(engine, [episode], SAMPLING, lambda r: r)
    assert tools.calls == [("calculator", {"expression": "17 * 23"}), ("calculator", {"expression": "391 + 9"})]
    requests = [call[0] for call in engine.calls]
    replayed = [engine.generate([r], SamplingParams(max_new_tokens=120), 0)[0] for r in requests]  # as the runner
    prompts, sampled = [r.prompt_ids for r in requests], [r.completion_ids for r in replayed]
    observations = [framing.observation_ids(tok, text, 2) for text in ("391", "400")]
    assert prompts[0] == tuple(prompt)
    for k in range(2):  # turn k + 1's prompt is turn k's prompt, every id turn k sampled, then the observation
        assert prompts[k + 1] == prompts[k] + tuple(sampled[k]) + tuple(observations[k])
    assert sampled == script
    rollout = episode.to_rollout(STOP)
    expected = sampled[0] + observations[0] + sampled[1] + observations[1] + sampled[2]
    assert rollout.completion_ids == expected
    assert tok.encode(tok.decode(expected), add_special_tokens=False) != expected  # re-tokenising would not give it
    assert rollout.response_ids() == sampled[2] and rollout.finish_reason == "stop"
    assert rollout.extras["episode"] == {"turns": 3, "tool_calls": 2, "tool_errors": {}, "end": "answer"}

    batch = collate([rollout], PAD, VOCAB)
    model = [t for ids in sampled for t in ids]
    assert batch.completion_ids[0][batch.mask[0]].tolist() == model  # the trained ids are the sampled ids
    assert batch.completion_ids[0][batch.observation_mask[0]].tolist() == observations[0] + observations[1]
    assert not (batch.mask & batch.observation_mask).any() and not batch.has_rollout[batch.observation_mask].any()
    engine_lps = [lp for r in replayed for lp in r.rollout_logprobs]
    assert batch.rollout_logprobs[0][batch.mask[0]].tolist() == pytest.approx(engine_lps, abs=1e-6)
    turns = [0] * (len(sampled[0]) + len(observations[0])) + [1] * (len(sampled[1]) + len(observations[1])) + \
        [2] * len(sampled[2])
    assert batch.turn_index[0].tolist() == turns


def test_masks_cover_exactly_the_model_tokens_with_single_turn_rows_and_padding():
    multi = Rollout(0, 0, [5, 6], [10, 11, 2, 20, 21, 12, 2], [-1.0, -1.0, -1.0, None, None, -1.0, -1.0], [3] * 7,
                    "stop", model_mask=[True, True, True, False, False, True, True], turn_index=[0, 0, 0, 0, 0, 1, 1])
    single = Rollout(1, 0, [5, 6, 7], [13, 2], [-0.5, -0.5], [3, 3], "stop")
    batch = collate([multi, single], PAD, VOCAB)
    assert batch.mask.tolist() == [[True, True, True, False, False, True, True], [True, True] + [False] * 5]
    assert batch.observation_mask.tolist() == [[False] * 3 + [True] * 2 + [False] * 2, [False] * 7]
    assert batch.turn_index.tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, -1, -1, -1, -1, -1]]
    assert batch.completion_lengths.tolist() == [7, 2]  # the observation is in the sequence the model attends to
    assert batch.mask.sum().item() == 7


@pytest.mark.parametrize("kwargs, message", [
    (dict(model_mask=[True, False]), "carry an engine log-prob"),
    (dict(model_mask=[True]), "1 model_mask entries"),
    (dict(turn_index=[1, 0]), "must not decrease"),
])
def test_a_rollout_with_inconsistent_episode_fields_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Rollout(0, 0, [1], [5, 6], [-1.0, -1.0], [0, 0], "length", **kwargs)


def test_a_resumed_partial_episode_keeps_its_masks_and_versions(tok, framing, prompt):
    script = _three_turns(tok)
    tools = FakeTools(Observation("391"), Observation("400"))
    runner = _runner(tok, framing, tools)
    episode = runner.new(3, 1, prompt)
    runner.run(ScriptedEngine(script, version=4), [episode], SAMPLING, lambda r: r, rounds=1)
    assert episode.turns == 1 and not episode.done
    saved = json.loads(json.dumps(episode.to_dict()))  # a checkpoint's plain JSON
    resumed = Episode.from_dict(saved)
    assert resumed == episode
    runner.run(ScriptedEngine(script, version=5), [resumed], SAMPLING, lambda r: r)
    rollout = resumed.to_rollout(STOP)
    first = len(script[0]) + len(framing.observation_ids(tok, "391", 2))
    n = len(rollout.completion_ids)
    assert len(rollout.model_mask) == len(rollout.turn_index) == len(rollout.versions) == n
    assert rollout.versions == [4] * first + [5] * (n - first)  # tokens sampled after the resume: the new version
    assert sum(rollout.model_mask) == sum(map(len, script)) and resumed.end == "answer"
    batch = collate([rollout], PAD, VOCAB)
    assert batch.mask.sum() == sum(map(len, script)) and batch.versions[0].tolist() == rollout.versions
    bad = dict(saved, versions=saved["versions"][:-1])
    with pytest.raises(ValueError, match="versions"):
        Episode.from_dict(bad)





def test_an_mcp_server_that_dies_mid_episode_is_an_error_observation_and_the_episode_goes_on(tok, framing, prompt,
                                                                                             tmp_path):
    script_file = tmp_path / "crashy.py"
    script_file.write_text(CRASHY)
    tools = ToolClient((sys.executable, str(script_file)), call_timeout_s=10)
    try:
        script = [_encode(tok, _call("crash")) + [2], _encode(tok, _call("echo", text="back again")) + [2],
                  _encode(tok, "Answer: 1") + [2]]
        runner = _runner(tok, framing, tools)
        episodes = [runner.new(0, 0, prompt)]
        runner.run(ScriptedEngine(script), episodes, SAMPLING, lambda r: r)
    finally:
        tools.close()
    episode = episodes[0]
    assert episode.end == "answer" and episode.turns == 3 and episode.tool_errors == {"server_died": 1}
    observed = [tok.decode([t for t, own, k in zip(episode.ids, episode.model_mask, episode.turn_index)
                            if not own and k == turn], skip_special_tokens=True) for turn in (0, 1)]
    assert "error: the tool server failed" in observed[0]
    assert observed[1] == "\ntool\nback again\nassistant\n"  # a new server answered the next call
    metrics = episode_metrics(episodes)
    assert metrics["episode/tool_errors"] == 1 and metrics["episode/tool_errors_server_died"] == 1
    assert metrics["episode/turns_mean"] == 3 and metrics["turn1/tool_calls"] == 1 and metrics["turn2/tool_calls"] == 0


def test_a_garbage_call_is_an_error_observation_the_model_reads(tok, framing, prompt):
    script = [_encode(tok, '<tool_call>{"name": calculator 17*23') + [2], _encode(tok, "Answer: 391") + [2]]
    tools = FakeTools()
    runner = _runner(tok, framing, tools)
    episode = runner.new(0, 0, prompt)
    runner.run(ScriptedEngine(script), [episode], SAMPLING, lambda r: r)
    assert tools.calls == [] and episode.tool_errors == {"malformed": 1} and episode.tool_calls == 1
    shown = tok.decode([t for t, own in zip(episode.ids, episode.model_mask) if not own], skip_special_tokens=True)
    assert "error: the tool call is not valid JSON" in shown and episode.end == "answer"


def test_episodes_end_at_the_turn_limit_and_the_token_budget(tok, framing, prompt):
    call = _encode(tok, _call("calculator", expression="1 + 1")) + [2]
    limited = _runner(tok, framing, FakeTools(Observation("2")), max_turns=2)
    episode = limited.new(0, 0, prompt)
    limited.run(ScriptedEngine([call]), [episode], SAMPLING, lambda r: r)
    assert (episode.end, episode.turns, episode.tool_calls) == ("turn_limit", 2, 1)  # the last turn's call never runs
    # a budget that holds the call but not its observation and one more token
    budget = len(call) + len(framing.observation_ids(tok, "2", 2))
    tight = _runner(tok, framing, FakeTools(Observation("2")), max_tokens=budget, turn_tokens=budget)
    episode = tight.new(0, 0, prompt)
    tight.run(ScriptedEngine([call]), [episode], SAMPLING, lambda r: r)
    assert episode.end == "token_budget" and len(episode.ids) == len(call) and episode.budget == budget - len(call)
    cut = _runner(tok, framing, FakeTools(), max_tokens=5, turn_tokens=5)
    episode = cut.new(0, 0, prompt)
    cut.run(ScriptedEngine([_encode(tok, "the answer is a long story") + [2]]), [episode], SAMPLING, lambda r: r)
    assert (episode.end, len(episode.ids), episode.to_rollout(STOP).finish_reason) == ("token_budget", 5, "length")


def _episode_rollouts(tok, framing, prompt, completions: int = 3) -> list[Rollout]:
    """`completions` episodes of one group (the same prompt) with different turns and observations."""
    rollouts = []
    for k in range(completions):
        script = [_encode(tok, _call("calculator", expression=f"{k} * 23")) + [2],
                  _encode(tok, "Answer: " + "9" * (k + 1)) + [2]]
        runner = _runner(tok, framing, FakeTools(Observation(str(23 * k))))
        episode = runner.new(0, k, prompt)
        runner.run(ScriptedEngine(script), [episode], SAMPLING, lambda r: r)
        rollouts.append(episode.to_rollout(STOP))
    return rollouts


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    return load_policy(str(tiny_model_dir))[0]


def test_the_shared_prompt_path_is_exact_with_observation_tokens_inside_completions(tok, framing, prompt, tiny):
    from nearpolicy.model.policy import sequence_logprobs

    rollouts = _episode_rollouts(tok, framing, prompt)
    assert all(not all(r.model_mask) for r in rollouts)
    results = []
    for shared in (False, True):
        batch = collate(rollouts, PAD, VOCAB, shared_prompt=shared)
        model = copy.deepcopy(tiny)
        logprobs, _ = sequence_logprobs(model, batch, SAMPLING)
        loss = -torch.where(batch.mask, logprobs, 0.0).sum() / batch.mask.sum()
        loss.backward()
        valid = batch.mask | batch.observation_mask
        results.append((logprobs.detach()[valid], {n: p.grad for n, p in model.named_parameters()}))
    (padded, g_padded), (shared, g_shared) = results
    assert torch.allclose(shared, padded, atol=2e-5, rtol=0)
    for name, g in g_padded.items():
        assert float((g_shared[name] - g).norm()) <= 2e-5 * float(g.norm()) + 1e-12, name


def test_the_policy_loss_and_the_mismatch_metrics_ignore_observation_tokens(tok, framing, prompt, tiny):
    from nearpolicy.ops.correction_presets import correction_spec
    from nearpolicy.ops.diagnostics import mismatch_metrics
    from nearpolicy.ops.losses import PolicyLossParams
    from nearpolicy.model.policy import recompute_logprobs
    from nearpolicy.training.update import UpdateSettings, policy_update

    rollouts = _episode_rollouts(tok, framing, prompt)
    batch = collate(rollouts, PAD, VOCAB)
    old, _ = recompute_logprobs(tiny, batch, SAMPLING, 8)
    batch.rollout_logprobs = torch.where(batch.mask, old - 0.05, batch.rollout_logprobs)
    poisoned = copy.copy(batch)  # every observation slot holds garbage the engine never reported
    obs = batch.observation_mask
    garbage = torch.full(obs.shape, math.nan)
    garbage[:, ::3], garbage[:, 1::3] = 1e30, -math.inf
    poisoned.rollout_logprobs = torch.where(obs, garbage, batch.rollout_logprobs)
    poisoned.has_rollout = batch.has_rollout | obs
    poisoned_old = torch.where(obs, 1e30, old)
    settings = UpdateSettings(1, 8, 1.0, "ppo_clip", PolicyLossParams(), "token-mean", None,
                              correction_spec("tis", upper=2.0))
    out = []
    for b, o in ((batch, old), (poisoned, poisoned_old)):
        model, grads = copy.deepcopy(tiny), []
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        result = policy_update(model, optimizer, b, o, torch.tensor([1.0, -0.5, 0.25]), SAMPLING, settings,
                               on_step=lambda: grads.append(torch.cat([p.grad.flatten() for p in model.parameters()])))
        defined = b.mask & b.has_rollout
        out.append((result.metrics, {k: float(v) for k, v in mismatch_metrics(o, b.rollout_logprobs, defined).items()},
                    grads[0]))
    (m_clean, mm_clean, g_clean), (m_poisoned, mm_poisoned, g_poisoned) = out
    assert math.isfinite(m_clean["actor/loss"]) and m_clean["actor/grad_norm"] > 0
    assert m_poisoned["actor/loss"] == m_clean["actor/loss"]
    assert torch.equal(g_poisoned, g_clean)  # bit for bit: the garbage is selected away, never multiplied by 0
    assert mm_clean["tokens"] == float(batch.mask.sum()) and mm_clean["k1"] == pytest.approx(-0.05, abs=1e-5)  # log mu - log pi_old
    assert mm_poisoned == pytest.approx(mm_clean, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("sets, message", [
    (["episode.enabled=true", "engine.kind=vllm"], "not supported with engine.kind = 'vllm'"),
    (["episode.turn_tokens=300", "episode.max_tokens=200"], "exceeds episode.max_tokens"),
    (['episode.example=[{role = "robot", content = "hi"}]'], r"episode.example\[0\] must be"),
    (["episode.max_turns=0"], "episode.max_turns"),
])
def test_unsupported_episode_configs_are_refused_naming_the_keys(sets, message):
    from nearpolicy.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_the_tools_config_runs_episodes_on_the_main_jobs_model_and_engine():
    from pathlib import Path

    from nearpolicy.config.schema import load_config
    from nearpolicy.config.reference import config_toml

    cfg = load_config(Path(__file__).parent.parent / "configs" / "tools.toml")
    assert cfg.episode.enabled and cfg.engine.kind == "llamacpp" and cfg.model.path == "smollm2"
    assert cfg.task.name == "products" and cfg.rollout.engines == 0
    roles = [m["role"] for m in cfg.episode.example]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert parse_tool_call(cfg.episode.example[1]["content"]) == ToolCall("calculator", {"expression": "25 * 31"})
    import tomllib

    from nearpolicy.config.schema import config_from_data

    assert config_from_data(tomllib.loads(config_toml(cfg))) == cfg  # the dry-run TOML reads back


# -- review findings --------------------------------------------------------------------------------------------
def test_a_call_with_a_lone_surrogate_is_malformed_and_a_tool_text_with_one_is_tokenised(framing, tok):
    call = parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "\\ud800"}}</tool_call>')
    assert isinstance(call, MalformedCall) and "UTF-8" in call.reason
    ids = framing.observation_ids(tok, "7\ud8008", 2)  # a third-party server's bad text: replaced, never a crash
    assert tok.decode(ids[len(framing.prefix) - 1: -len(framing.suffix)]) == "7?8"


def test_a_turn_ended_by_another_stop_id_keeps_the_whole_framing(framing, tok):
    """Only the id the prefix starts with (<|im_end|>, 2) is dropped: a turn that ended on <|endoftext|> (0) still
    gets <|im_end|> before the tool message."""
    assert framing.prefix[0] == 2
    assert framing.observation_ids(tok, "391", 0)[: len(framing.prefix)] == list(framing.prefix)
    assert framing.observation_ids(tok, "391", 2)[: len(framing.prefix) - 1] == list(framing.prefix[1:])


def test_greedy_turns_never_ask_for_more_than_an_episodes_budget():
    """The greedy eval runs one call per distinct limit min(turn_tokens, budget): a prompt + limit within the
    start-up check's prompt + budget, never prompt + turn_tokens (which could pass the context)."""
    from nearpolicy.rollouts.episodes import _greedy_by_limit

    calls = []

    class Recorder:
        def greedy(self, prompts, max_new_tokens):
            calls.append((len(prompts), max_new_tokens))
            return [[5] * 40 for _ in prompts]

    live = [Episode(0, 0, [1, 2], budget=8), Episode(1, 0, [3], budget=50), Episode(2, 0, [4], budget=8)]
    out = _greedy_by_limit(Recorder(), live, 30)
    assert sorted(calls) == [(1, 30), (2, 8)]
    assert [len(ids) for ids in out] == [8, 30, 8]
