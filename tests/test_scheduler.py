"""The rollout scheduler under random generation latencies, interruptions and engine crashes (hypothesis):
the staleness bound is never exceeded, version labels and per-token log-probs are exact, every group is trained
exactly once and none is lost; eta = 0 is synchronous; partial rollouts off never mix versions in a sample."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nearpolicy.rollouts.scheduler import RolloutScheduler, staleness_metrics
from nearpolicy.rollouts.types import SegmentResult


def token_logprob(group: int, sample: int, position: int, version: int) -> float:
    """What the simulated engine reports: a function of where the token is and which weights made it."""
    return -((group * 7 + sample * 3 + position) % 11) / 10 - version / 1000


class SimEngine:
    """Generates one token per sample per tick for every segment it holds; `lengths` fixes each sample's total."""

    def __init__(self, sched: RolloutScheduler, lengths: dict):
        self.sched, self.lengths, self.version = sched, lengths, 0
        self.running: list[tuple] = []  # (segment, {sample: new tokens so far})

    def start(self, segment) -> None:
        assert segment.version == self.version, "a segment must run on the weights of its version"
        self.running.append((segment, {i: [] for i in segment.sample_indices}))

    def tick(self, n_tokens: int) -> list[SegmentResult]:
        out, keep = [], []
        for seg, new in self.running:
            done = []
            for i, toks in new.items():
                have = len(self.sched.sample(seg.group_id, i).completion_ids)
                target = self.lengths[(seg.group_id, i)]
                for _ in range(n_tokens):
                    if have + len(toks) >= target:
                        break
                    toks.append(have + len(toks))
                if have + len(toks) >= target:
                    done.append(i)
            for i in done:
                out.append(self._result(seg, i, new.pop(i), "stop"))
            if new:
                keep.append((seg, new))
        self.running = keep
        return out

    def interrupt(self, version: int) -> list[SegmentResult]:
        out = [self._result(seg, i, toks, "interrupted") for seg, new in self.running for i, toks in new.items()]
        self.running, self.version = [], version
        return out

    def crash(self) -> list:
        lost, self.running = [seg for seg, _ in self.running], []
        return lost

    def _result(self, seg, i, positions, finish) -> SegmentResult:
        lps = tuple(token_logprob(seg.group_id, i, p, seg.version) for p in positions)
        return SegmentResult(seg.group_id, i, seg.version, tuple(positions), lps, finish)


def run_simulation(eta, partial, overprovision, group_size, groups_per_step, steps, events, lengths_draw):
    sched = RolloutScheduler(group_size, groups_per_step, eta, 64, partial=partial, overprovision=overprovision)
    lengths: dict = {}
    engines = [SimEngine(sched, lengths), SimEngine(sched, lengths)]
    trained: list[int] = []
    events = iter(events)

    def issue():
        for k, seg in enumerate(sched.next_segments()):
            for i in seg.sample_indices:
                lengths.setdefault((seg.group_id, i), lengths_draw(seg.group_id, i))
            engines[(seg.group_id + k) % 2].start(seg)
            bound = (eta + sched.version + 1) * sched.batch_samples + overprovision * group_size
            assert sched.produced + sched.unfinished_samples() <= bound

    for _ in range(4000):
        if len(trained) >= steps * groups_per_step:
            break
        issue()
        kind, arg = next(events, ("tick", 3))
        if kind == "crash":
            for seg in engines[arg % 2].crash():
                sched.lost(seg)
            continue
        for engine in engines:
            for r in engine.tick(arg if kind == "tick" else 1):
                sched.on_result(r)
        batch = sched.take_batch()
        if batch is None:
            continue
        v = sched.version
        for g in batch:
            for i, s in enumerate(g.samples):
                assert all(v - tv <= eta for tv in s.versions), "staleness bound exceeded"
                assert s.logprobs == [token_logprob(g.group_id, i, p, tv) for p, tv in zip(s.completion_ids, s.versions)]
                assert s.completion_ids == list(range(lengths[(g.group_id, i)]))  # nothing lost or repeated
                assert s.versions == sorted(s.versions)
                if not partial:
                    assert len(set(s.versions)) == 1, "a sample mixes versions with partial rollouts off"
            assert staleness_metrics(batch, v)["staleness/max"] <= eta
        trained += [g.group_id for g in batch]
        sched.publish(v + 1)
        for engine in engines:
            for r in engine.interrupt(v + 1):
                sched.on_result(r)
    assert len(trained) >= steps * groups_per_step, "the simulation did not finish"
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert set(trained) | set(sched.groups) == set(range(sched.next_group_id)), "a group was lost"
    return sched, trained


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(eta=st.integers(0, 3), partial=st.booleans(), overprovision=st.integers(0, 3), group_size=st.integers(1, 3),
       groups_per_step=st.integers(1, 3), seed=st.integers(0, 10**6),
       events=st.lists(st.one_of(st.tuples(st.just("tick"), st.integers(1, 8)),
                                 st.tuples(st.just("crash"), st.integers(0, 1))), max_size=200))
def test_bound_versions_and_exactly_once_under_random_latencies(eta, partial, overprovision, group_size,
                                                                 groups_per_step, seed, events):
    import random

    if partial and eta == 0:
        with pytest.raises(ValueError, match="eta >= 1"):
            RolloutScheduler(group_size, groups_per_step, eta, 64, partial=True)
        return
    rng = random.Random(seed)
    lengths = lambda g, i: 1 + int(rng.paretovariate(1.2)) % 40  # noqa: E731 - long-tailed response lengths
    run_simulation(eta, partial, overprovision, group_size, groups_per_step, 4, events, lengths)


def test_eta_zero_is_synchronous():
    """With eta = 0 exactly one batch is issued per version, and every trained token has lag 0."""
    sched = RolloutScheduler(2, 2, 0, 64)
    for version in range(3):
        segments = sched.next_segments()
        assert [s.fresh for s in segments] == [True, True] and all(s.version == version for s in segments)
        assert sched.next_segments() == []  # nothing more until the update
        for s in segments:
            for i in s.sample_indices:
                sched.on_result(SegmentResult(s.group_id, i, version, (1, 2), (-0.1, -0.2), "stop"))
        batch = sched.take_batch()
        assert [g.group_id for g in batch] == [2 * version, 2 * version + 1]
        assert staleness_metrics(batch, version)["staleness/off_policy_token_frac"] == 0.0
        sched.publish(version + 1)


def test_partial_rollout_keeps_tokens_and_versions_across_an_update():
    sched = RolloutScheduler(1, 1, 1, 64, partial=True)
    first = sched.next_segments()  # eta 1: two groups at version 0
    assert [s.group_id for s in first] == [0, 1]
    sched.on_result(SegmentResult(0, 0, 0, (5,), (-0.5,), "stop"))
    sched.on_result(SegmentResult(1, 0, 0, (7, 8), (-0.7, -0.8), "interrupted"))
    assert [g.group_id for g in sched.take_batch()] == [0]
    sched.publish(1)
    resumed = sched.next_segments()
    assert resumed[0].group_id == 1 and not resumed[0].fresh and resumed[0].version == 1  # resumed first
    assert sched.remaining_tokens(1, 0) == 62
    sched.on_result(SegmentResult(1, 0, 1, (9,), (-0.9,), "stop"))
    (group,) = sched.take_batch()
    s = group.samples[0]
    assert (s.completion_ids, s.logprobs, s.versions) == ([7, 8, 9], [-0.7, -0.8, -0.9], [0, 0, 1])
    m = staleness_metrics([group], 1)
    assert m["staleness/off_policy_token_frac"] == pytest.approx(2 / 3) and m["staleness/mixed_version_sample_frac"] == 1


def test_too_stale_group_is_dropped_and_reissued_and_fresh_only_waits():
    sched = RolloutScheduler(1, 1, 1, 64)
    sched.next_segments()  # groups 0 and 1 at version 0
    sched.on_result(SegmentResult(0, 0, 0, (1,), (-0.1,), "stop"))
    assert sched.take_batch()[0].group_id == 0
    sched.publish(1)
    sched.on_result(SegmentResult(1, 0, 0, (1,), (-0.1,), "stop"))  # finished with the old weights
    assert sched.take_batch(fresh_only=True) is None  # a resync: group 1 (version 0) is not fresh
    assert sched.stats["dropped_stale_groups"] == 1
    again = sched.next_segments()
    assert again[0].group_id == 1 and again[0].fresh and again[0].version == 1


def test_restart_reissues_untrained_groups_first_and_keeps_the_bound():
    sched = RolloutScheduler(2, 1, 1, 64)
    sched.next_segments()
    for i in range(2):
        sched.on_result(SegmentResult(0, i, 0, (1,), (-0.1,), "stop"))
    sched.take_batch()
    sched.publish(1)
    state = sched.state_dict()
    assert state == {"version": 1, "next_group_id": 2, "consumed_groups": 1, "untrained_groups": [1]}
    fresh = RolloutScheduler(2, 1, 1, 64)
    fresh.load_state_dict(state)
    segments = fresh.next_segments()
    assert [s.group_id for s in segments] == [1, 2]  # the untrained group first, then new ones within the bound
    assert fresh.produced + fresh.unfinished_samples() == (1 + 1 + 1) * 2


def test_duplicate_result_is_refused():
    sched = RolloutScheduler(1, 1, 0, 64)
    sched.next_segments()
    sched.on_result(SegmentResult(0, 0, 0, (1,), (-0.1,), "stop"))
    with pytest.raises(ValueError, match="not in flight"):
        sched.on_result(SegmentResult(0, 0, 0, (1,), (-0.1,), "stop"))


def test_a_dead_replica_is_named_by_its_signal_and_restarted():
    from types import SimpleNamespace

    from nearpolicy.rollouts.service import RolloutService

    restarted, said = [], []
    pool = SimpleNamespace(replicas=2, restart=lambda w, path, version: restarted.append((w, path, version)))
    scheduler = SimpleNamespace(version=3, lost=lambda seg: None)
    service = RolloutService(scheduler, pool, lambda g: (1,), None, 0, 4, "engine.gguf", log=said.append)
    service._handle([(1, "died", -11), (0, "died", 3)])
    assert said == ["warning: engine replica 1 died (SIGSEGV); restarting it and re-issuing its segments",
                    "warning: engine replica 0 died (exit code 3); restarting it and re-issuing its segments"]
    assert restarted == [(1, "engine.gguf", 3), (0, "engine.gguf", 3)] and service.counters["engine_restarts"] == 2


def test_the_service_sums_the_replicas_decode_counts_until_they_are_taken():
    from types import SimpleNamespace

    from nearpolicy.engines.base import DecodeCounts
    from nearpolicy.rollouts.service import RolloutService

    received = []
    scheduler = SimpleNamespace(version=0, on_result=received.append)
    service = RolloutService(scheduler, SimpleNamespace(replicas=2), lambda g: (1,), None, 0, 4, "engine.gguf")
    assert service.take_decode_metrics() == {}  # no replica has reported: no metric, not a zero
    result = SegmentResult(0, 0, 0, (5, 6), (-1.0, -2.0), "length")
    service._handle([(0, "results", (1, [result], DecodeCounts(3, 6, 12))),  # replica 0: 3 calls of 2 in 4 slots
                     (1, "results", (2, [], DecodeCounts(1, 4, 4))),  # replica 1: one full call
                     (0, "results", (3, [], None))])  # an engine that does not count adds nothing
    assert received == [result]
    assert service.take_decode_metrics() == {"rollout/decode_calls": 4.0, "rollout/decode_batch_mean": 10 / 4,
                                             "rollout/decode_occupancy": 10 / 16}
    assert service.take_decode_metrics() == {"rollout/decode_calls": 0.0}  # taken: the next take counts afresh
