"""Rollout scheduling with bounded staleness and partial rollouts: the bookkeeping, with no I/O.

Units: B = samples per training step (groups_per_step x G); v = the trainer's policy version (number of updates
done). A *group* (G samples of one prompt) is issued to an engine; a *segment* is one stretch of generation of one
sample at one policy version (a whole group's first segments go out together so the prompt is evaluated once).

Staleness bound eta (AReaL, arXiv:2505.24298 sec. 5): new groups are issued only while
    (eta + v + 1) * B - (produced + in_flight) >= G,
where produced counts completed samples (trained or waiting) and in_flight counts issued, unfinished ones.
eta = 0 is exactly synchronous. Every token carries the version of the segment that generated it, pinned when
the segment was issued. At consumption (trainer version v), a group whose oldest token is older than v - eta is
never trained: it is dropped and issued again from scratch (counted), so the bound holds for every trained token.

Partial rollouts (APRIL, arXiv:2509.18521): `overprovision` extra groups may be in flight; a weight update
interrupts in-flight segments; with `partial=True` an interrupted sample keeps its tokens (with their log-probs
and versions) and continues first after the sync at the new version; with `partial=False` it restarts from
scratch, so no sample ever mixes versions. After a restart, issued but untrained groups are issued again first.

Tool-use episodes: a sample is an episode (rollouts/episode_state.Episode) and a segment is its turns at one
version, the tool observations between them included (their ids carry the segment's version, log-prob None). The
sample keeps the returned episode beside its ids, log-probs and versions (checked equal), so an interrupted episode
continues mid-turn or between turns with its masks, turn index and tool counters; the accounting is the same."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from nearpolicy.rollouts.episode_state import Episode
from nearpolicy.rollouts.types import SegmentResult


@dataclass
class SampleState:
    """One sample's tokens so far: ids, engine log-probs (None for a tool observation's ids) and the policy version
    of each token; in a tool-use run, its episode so far."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" / "length" when complete
    episode: Episode | None = None

    def reset(self) -> None:
        self.completion_ids, self.logprobs, self.versions, self.finish, self.episode = [], [], [], None, None


@dataclass
class GroupState:
    group_id: int  # the data position of its prompt
    samples: list[SampleState]
    issues: int = 1  # how many times the group was issued from scratch

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest_version(self) -> int:
        return min(v for s in self.samples for v in s.versions) if any(s.versions for s in self.samples) else -1


@dataclass(frozen=True)
class Segment:
    """Work for an engine: continue `sample_indices` of a group (all G at once for a fresh group) from their
    current tokens, for at most `max_new_tokens` more each, with the weights of `version`."""

    group_id: int
    sample_indices: tuple[int, ...]
    version: int
    fresh: bool  # True: the whole group from its prompt (evaluate the prompt once, n = G)


class RolloutScheduler:
    """Staleness-bounded issue, partial-rollout bookkeeping and consumption of complete groups."""

    def __init__(self, group_size: int, groups_per_step: int, eta: int, max_new_tokens: int, *,
                 partial: bool = False, overprovision: int = 0, next_group_id: int = 0):
        if eta < 0 or overprovision < 0:
            raise ValueError(f"eta and overprovision must be >= 0, got {eta}, {overprovision}")
        if partial and eta < 1:
            raise ValueError("partial rollouts keep tokens across a weight update, so they need eta >= 1")
        self.G, self.groups_per_step, self.eta = group_size, groups_per_step, eta
        self.max_new_tokens, self.partial, self.overprovision = max_new_tokens, partial, overprovision
        self.version = 0
        self.next_group_id = next_group_id
        self.groups: dict[int, GroupState] = {}
        self.waiting: deque[Segment] = deque()  # segments to issue before any new group (resume first)
        self.in_flight: set[tuple[int, int]] = set()  # (group, sample) issued, not returned
        self.ready: list[int] = []  # complete groups, completion order
        self.produced = 0  # completed samples not dropped (trained ones included)
        self.consumed_groups = 0
        self.stats: Counter = Counter()

    # -- accounting -----------------------------------------------------------------------------
    @property
    def batch_samples(self) -> int:
        return self.groups_per_step * self.G

    def unfinished_samples(self) -> int:
        """Samples issued or waiting to be issued that are not complete."""
        return sum(1 for g in self.groups.values() for s in g.samples if s.finish is None)

    def capacity(self) -> int:
        """(eta + v + 1) * B + overprovision * G - (produced + in flight), in samples."""
        limit = (self.eta + self.version + 1) * self.batch_samples + self.overprovision * self.G
        return limit - (self.produced + self.unfinished_samples())

    # -- issue ----------------------------------------------------------------------------------
    def next_segments(self, limit: int | None = None, strict: bool = False) -> list[Segment]:
        """What may be issued now, at most `limit` samples (at least one segment when any is due, unless `strict`):
        waiting segments first (continuations, restarts), then new groups while the staleness bound allows. The
        segments are marked in flight at the current version."""
        out, used = [], 0
        fits = lambda n: limit is None or (not out and not strict) or used + n <= limit  # noqa: E731
        while self.waiting and fits(len(self.waiting[0].sample_indices)):
            seg = self.waiting.popleft()
            out.append(Segment(seg.group_id, seg.sample_indices, self.version, seg.fresh))
            used += len(seg.sample_indices)
        while self.capacity() >= self.G and not self.waiting and fits(self.G):
            gid = self.next_group_id
            self.next_group_id += 1
            self.groups[gid] = GroupState(gid, [SampleState() for _ in range(self.G)])
            out.append(Segment(gid, tuple(range(self.G)), self.version, True))
            used += self.G
        for seg in out:
            self.in_flight.update((seg.group_id, i) for i in seg.sample_indices)
        return out

    def remaining_tokens(self, group_id: int, sample_index: int) -> int:
        return self.max_new_tokens - len(self.groups[group_id].samples[sample_index].completion_ids)

    def sample(self, group_id: int, sample_index: int) -> SampleState:
        return self.groups[group_id].samples[sample_index]

    # -- results --------------------------------------------------------------------------------
    def on_result(self, r: SegmentResult) -> None:
        """Record one sample's segment. Raises ValueError for a result that was not in flight (a duplicate), and
        for an episode whose ids, log-probs or versions are not the sample's tokens with the segment's appended."""
        key = (r.group_id, r.sample_index)
        if key not in self.in_flight:
            raise ValueError(f"result for group {r.group_id} sample {r.sample_index} that is not in flight")
        self.in_flight.discard(key)
        s = self.groups[r.group_id].samples[r.sample_index]
        s.completion_ids += r.completion_ids
        s.logprobs += r.logprobs
        s.versions += [r.version] * len(r.completion_ids)
        if r.episode is not None:
            e = r.episode
            if (e.ids, e.logprobs, e.versions) != (s.completion_ids, s.logprobs, s.versions):
                raise ValueError(f"the episode of group {r.group_id} sample {r.sample_index} disagrees with the "
                                 "sample's tokens")
            s.episode = e
        if r.finish == "interrupted":
            if not self.partial and s.versions:
                self.stats["restarted_samples"] += 1
                s.reset()
            self._wait(r.group_id, (r.sample_index,), fresh=not s.completion_ids)
            return
        s.finish = r.finish
        self.produced += 1
        if self.groups[r.group_id].complete:
            self.ready.append(r.group_id)

    def lost(self, segment: Segment) -> None:
        """An engine died with `segment` in flight: its samples still in flight (not already returned) are issued
        again from where they were."""
        lost = tuple(i for i in segment.sample_indices if (segment.group_id, i) in self.in_flight)
        if not lost:
            return
        self.in_flight.difference_update((segment.group_id, i) for i in lost)
        self._wait(segment.group_id, lost, fresh=segment.fresh)
        self.stats["reissued_segments"] += 1

    def _wait(self, group_id: int, indices: tuple[int, ...], fresh: bool) -> None:
        g = self.groups[group_id]
        if fresh and len(indices) == self.G and not any(s.completion_ids for s in g.samples):
            self.waiting.appendleft(Segment(group_id, indices, self.version, True))
        else:
            self.waiting.append(Segment(group_id, indices, self.version, False))

    # -- weights and consumption ----------------------------------------------------------------
    def publish(self, version: int) -> None:
        """The engines now hold `version` (in-flight segments come back as interrupted and continue)."""
        if version <= self.version:
            raise ValueError(f"published version {version} is not newer than {self.version}")
        self.version = version

    def take_batch(self, fresh_only: bool = False) -> list[GroupState] | None:
        """groups_per_step complete groups (completion order) whose every token is within eta versions of the
        trainer's (`fresh_only`: generated by the current version), or None when not enough are ready yet.
        Ready groups that are too stale are dropped and issued again from scratch."""
        oldest_allowed = self.version - (0 if fresh_only else self.eta)
        for gid in [g for g in self.ready if self.groups[g].oldest_version() < oldest_allowed]:
            self._drop(gid)
        if len(self.ready) < self.groups_per_step:
            return None
        taken, self.ready = self.ready[: self.groups_per_step], self.ready[self.groups_per_step:]
        self.consumed_groups += len(taken)
        return [self.groups.pop(gid) for gid in taken]

    def _drop(self, group_id: int) -> None:
        self.ready.remove(group_id)
        g = self.groups[group_id]
        self.produced -= self.G
        for s in g.samples:
            s.reset()
        g.issues += 1
        self.stats["dropped_stale_groups"] += 1
        self.waiting.appendleft(Segment(group_id, tuple(range(self.G)), self.version, True))

    # -- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps: the version, the next new group id and the issued but untrained groups
        (issued again from scratch after a restart, first), so the bound and the data order survive."""
        return {"version": self.version, "next_group_id": self.next_group_id, "consumed_groups": self.consumed_groups,
                "untrained_groups": sorted(self.groups)}

    def load_state_dict(self, state: dict) -> None:
        self.version, self.next_group_id = state["version"], state["next_group_id"]
        self.consumed_groups = state["consumed_groups"]
        self.produced = self.consumed_groups * self.G
        self.groups, self.ready, self.in_flight = {}, [], set()
        self.waiting = deque()
        for gid in state["untrained_groups"]:
            self.groups[gid] = GroupState(gid, [SampleState() for _ in range(self.G)])
            self.waiting.append(Segment(gid, tuple(range(self.G)), self.version, True))


def _trained_versions(s: SampleState) -> list[int]:
    if s.episode is None:
        return s.versions
    return [v for v, own in zip(s.versions, s.episode.model_mask, strict=True) if own]


def staleness_metrics(groups: list[GroupState], version: int) -> dict[str, float]:
    """Token version lag v - v_token over the trained tokens of a batch (a tool-use episode's model tokens only: its
    observation ids are never trained): histogram (lag 0..3, 4+), mean, max, the share of off-policy tokens (lag >
    0) and of samples that mix versions."""
    lags = [version - v for g in groups for s in g.samples for v in _trained_versions(s)]
    samples = [s for g in groups for s in g.samples]
    n = max(len(lags), 1)
    hist = Counter(min(lag, 4) for lag in lags)
    out = {f"staleness/tokens_lag_{k if k < 4 else '4plus'}": hist.get(k, 0) / n for k in range(5)}
    return out | {
        "staleness/mean": sum(lags) / n, "staleness/max": float(max(lags, default=0)),
        "staleness/off_policy_token_frac": sum(lag > 0 for lag in lags) / n,
        "staleness/mixed_version_sample_frac": sum(len(set(s.versions)) > 1 for s in samples) / max(len(samples), 1),
    }
