"""Turn-level credit for multi-turn episodes: token advantages [N, T] from the outcome reward of each episode and,
for some estimators, turn-level signals. One signature for every registered estimator:

    (rewards [N] float (NaN = unscorable), group_ids [N] int64, turn_index [N, T] int64 (turn of each completion
     token, -1 at padding), model_mask [N, T] bool (the model's own sampled tokens), values [N, K + 1] float | None
     (TRACE's state value at boundary k: start of the episode (k = 0), after each tool observation (k >= 1); NaN
     where an episode has no such boundary), params TurnCreditParams)
    -> TurnCreditResult(advantages [N, T] float32, 0 off the model mask; keep [N] bool; metrics dict[str, Tensor])

Turn k of an episode is the model's tokens with turn_index == k (only the model's tokens are read, so the turn
index an observation token carries is never used). An episode has n_i = 1 + its largest turn index over model
tokens turns (0 with no model token). Boundary k (k >= 1) follows turn k - 1's tool observation, so values[i, k]
is the state before turn k.

Normalisation is per group id, never batch-wide. As in ops/advantages.py (invariant 6): unscorable episodes (NaN
reward) get advantage 0 on every token and are left out of every statistic; singleton groups (fewer than 2
scorable episodes) and constant groups give 0; a std at or below STD_FLOOR is not divided by. An episode of zero
or one turn gets the outcome GRPO advantage under every estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nearpolicy.ops.advantages import grpo_advantages
from nearpolicy.ops.masked import select
from nearpolicy.registry import Registry


DEFAULT_ANSWER_FORMAT = "Answer: {answer}"  # TRACE's gold answer as the model writes it (task.system_prompt's line)


@dataclass(frozen=True)
class TurnCreditParams:
    """Hyper-parameters of the turn-credit estimators (config [algorithm] reads its defaults from here).
    trace_weight: beta >= 0, weight of TRACE's group-normalised turn reward added to the outcome advantage."""

    trace_weight: float = 1.0

    def __post_init__(self) -> None:
        if not (self.trace_weight >= 0 and self.trace_weight != float("inf")):
            raise ValueError(f"trace_weight must be a finite number >= 0, got {self.trace_weight!r}")


@dataclass(frozen=True)
class TurnCreditResult:
    """advantages [N, T] float32 (0 wherever model_mask is False: observation, template and padding tokens);
    keep [N] bool (all True for the estimators here; the caller ANDs it into the loss mask as for
    AdvantageResult); metrics: scalar tensors keyed "turn_credit/..."."""

    advantages: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


TurnCreditFn = Callable[..., TurnCreditResult]
TURN_CREDIT: Registry[TurnCreditFn] = Registry("turn-credit estimator")


def episode_turns(turn_index: torch.Tensor, model_mask: torch.Tensor) -> torch.Tensor:
    """n_i [N] int64: 1 + the largest turn index over each row's model tokens (0 for a row with none)."""
    if turn_index.shape[1] == 0:
        return torch.zeros(turn_index.shape[0], dtype=torch.long)
    return torch.where(model_mask, turn_index, torch.full_like(turn_index, -1)).max(dim=1).values + 1


def _check(rewards, group_ids, turn_index, model_mask, values) -> None:
    """Raise ValueError naming the first input of the wrong shape or dtype, or a model token without a turn."""
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor [N], got shape {tuple(rewards.shape)} {rewards.dtype}")
    n = rewards.shape[0]
    if group_ids.shape != (n,) or group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor [{n}], got {tuple(group_ids.shape)} {group_ids.dtype}")
    if turn_index.dim() != 2 or turn_index.shape[0] != n or turn_index.is_floating_point():
        raise ValueError(f"turn_index must be an integer tensor [{n}, T], got {tuple(turn_index.shape)} "
                         f"{turn_index.dtype}")
    if model_mask.shape != turn_index.shape or model_mask.dtype != torch.bool:
        raise ValueError(f"model_mask must be a bool tensor of turn_index's shape {tuple(turn_index.shape)}, got "
                         f"{tuple(model_mask.shape)} {model_mask.dtype}")
    if bool((model_mask & (turn_index < 0)).any()):
        raise ValueError("a model token has turn_index < 0: every model token needs its turn (-1 is padding only)")
    if values is not None and (values.dim() != 2 or values.shape[0] != n or not values.is_floating_point()):
        raise ValueError(f"values must be a float tensor [{n}, K + 1], got {tuple(values.shape)} {values.dtype}")


def _scorable_group_size(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] int64: scorable (finite-reward) episodes in each episode's group."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=torch.long)
    counts.index_add_(0, inverse, torch.isfinite(rewards).long())
    return counts[inverse]


def _to_tokens(table: torch.Tensor, turn_index: torch.Tensor, model_mask: torch.Tensor) -> torch.Tensor:
    """Token advantages [N, T] float32: table[i, turn_index[i, t]] ([N, K] per-turn values) at model tokens, else 0."""
    if table.shape[1] == 0:
        return torch.zeros(turn_index.shape, dtype=torch.float32)
    index = turn_index.clamp(0, table.shape[1] - 1)
    return select(table.gather(1, index), model_mask).float()


def _turn_grid(n_turns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k [N, K] int64 turn numbers 0..K-1, exists [N, K] bool: k < n_i), K = max(n_i, 1)."""
    width = max(int(n_turns.max()) if n_turns.numel() else 0, 1)
    k = torch.arange(width).expand(len(n_turns), width)
    return k, k < n_turns[:, None]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return select(values, mask).sum() / mask.sum().clamp_min(1)


@TURN_CREDIT.register("outcome", summary="GRPO advantage of the episode reward on every model token of the episode",
                      source="DeepSeekMath arXiv:2402.03300 eq. 3 (outcome supervision), over episodes")
def outcome_credit(rewards: torch.Tensor, group_ids: torch.Tensor, turn_index: torch.Tensor,
                   model_mask: torch.Tensor, values: torch.Tensor | None = None,
                   params: TurnCreditParams = TurnCreditParams()) -> TurnCreditResult:
    """A[i, t] = ADVANTAGES["grpo"](rewards, group_ids)[i] at model tokens, 0 elsewhere (values, params unused)."""
    del values, params
    adv = grpo_advantages(rewards, group_ids).advantages.float()
    n_turns = episode_turns(turn_index, model_mask)
    tokens = select(adv[:, None].expand_as(model_mask), model_mask)
    return TurnCreditResult(tokens, torch.ones_like(rewards, dtype=torch.bool),
                            {"turn_credit/turns_mean": n_turns.double().mean()})


def td_turn_rewards(values: torch.Tensor, n_turns: torch.Tensor) -> torch.Tensor:
    """TRACE's turn rewards [N, K] float64: r[i, k] = values[i, k + 1] - values[i, k] for turns k < n_i whose two
    boundaries both have a finite value, NaN elsewhere (K = max(n_i, 1)). With every boundary finite they telescope:
    sum_k r[i, k] = values[i, m] - values[i, 0], m = the last finite boundary not after n_i."""
    k, exists = _turn_grid(n_turns)
    v = values.double()
    pad = torch.full((len(v), max(k.shape[1] + 1 - v.shape[1], 0)), float("nan"), dtype=torch.float64)
    v = torch.cat([v, pad], dim=1)
    before, after = v.gather(1, k), v.gather(1, k + 1)
    ok = exists & torch.isfinite(before) & torch.isfinite(after)
    return torch.where(ok, after - before, torch.full_like(before, float("nan")))


@TURN_CREDIT.register("trace", summary="outcome GRPO advantage + beta x the group-normalised TD change of a "
                      "reference model's gold-answer log-ratio value across each turn",
                      source="TRACE, reconstructed from its description (issue 18; paper not located); turn "
                      "rewards as TD changes of a gold-answer log-likelihood potential as in TIPS arXiv:2603.22293")
def trace_credit(rewards: torch.Tensor, group_ids: torch.Tensor, turn_index: torch.Tensor,
                 model_mask: torch.Tensor, values: torch.Tensor | None = None,
                 params: TurnCreditParams = TurnCreditParams()) -> TurnCreditResult:
    """A[i, t] = A_out[i] + beta x A_turn[i, k(t)] at model tokens of turn k(t), 0 elsewhere (reconstruction).

    A_out = GRPO advantage of the rewards per group (the outcome estimator). Turn rewards r[i, k] =
    values[i, k + 1] - values[i, k] (td_turn_rewards: the TD change of the state value across turn k's tool call
    and observation, gamma = 1, so they telescope). A_turn standardises r over all turn rewards of the group's
    scorable episodes (mean, unbiased std; std <= STD_FLOOR not divided by; fewer than 2 turn rewards in the group
    -> 0); a turn with no TD reward (the answering turn, a one-turn episode) gets A_turn = 0, so one-turn episodes
    get A_out exactly. Unscorable episodes and groups with fewer than 2 scorable episodes get 0. values [N, K + 1]
    float (nats; turn_values.turn_values) is required: raises ValueError when None. beta = params.trace_weight."""
    if values is None:
        raise ValueError("turn credit 'trace' needs values [N, K + 1] (turn_values.turn_values of a reference model)")
    out = grpo_advantages(rewards, group_ids).advantages.double()
    n_turns = episode_turns(turn_index, model_mask)
    td = td_turn_rewards(values, n_turns)
    paired = torch.isfinite(rewards) & (_scorable_group_size(rewards, group_ids) > 1)
    td = torch.where(paired[:, None], td, torch.full_like(td, float("nan")))
    flat_groups = group_ids[:, None].expand_as(td).reshape(-1)
    turn_adv = grpo_advantages(td.reshape(-1), flat_groups).advantages.view_as(td)
    table = out[:, None] + params.trace_weight * turn_adv
    scored = torch.isfinite(td)
    metrics = {"turn_credit/turns_mean": n_turns.double().mean(),
               "turn_credit/td_reward_mean": _masked_mean(td, scored),
               "turn_credit/td_reward_abs_mean": _masked_mean(td.abs(), scored),
               "turn_credit/td_turns": scored.sum()}
    return TurnCreditResult(_to_tokens(table, turn_index, model_mask), torch.ones_like(paired), metrics)


@TURN_CREDIT.register("rtpo", summary="outcome reward normalised per (group, turn counted from the last): the last "
                      "turns of short and long episodes are compared with each other",
                      source="RTPO (reverse-turn policy optimization), reconstructed from its abstract as quoted in "
                      "issue 18 (paper not located): credit indexed from the last turn backwards")
def rtpo_credit(rewards: torch.Tensor, group_ids: torch.Tensor, turn_index: torch.Tensor,
                model_mask: torch.Tensor, values: torch.Tensor | None = None,
                params: TurnCreditParams = TurnCreditParams()) -> TurnCreditResult:
    """A[i, t] = (R_i - mu_{g,j}) / sigma_{g,j} at the model tokens of turn k, j = n_i - 1 - k (the turn's place
    counted from the episode's last turn), 0 elsewhere (reconstruction; values and params unused).

    mu_{g,j}, sigma_{g,j}: mean and unbiased std of R over the scorable episodes of group g that have a turn j from
    their end (an episode of n turns takes part in j = 0 .. n - 1), with grpo's rules: sigma <= STD_FLOOR not
    divided by, fewer than 2 such episodes -> 0. j = 0 (every episode's last turn) is plain GRPO over the group;
    a turn that no other episode of the group reaches (the early turns of the group's longest episode) gets 0:
    the long trajectories, the ones most exposed to context mismatch and asynchronous drift, are credited only
    where shorter peers give a baseline. A zero-turn episode counts as one turn (j = 0 only), so the j = 0 statistics
    are grpo's and one-turn episodes get the outcome GRPO advantage exactly."""
    del values, params
    raw_turns = episode_turns(turn_index, model_mask)
    n_turns = raw_turns.clamp_min(1)  # a zero-turn episode is counted in j = 0
    k, exists = _turn_grid(n_turns)
    reverse = torch.where(exists, n_turns[:, None] - 1 - k, torch.full_like(k, -1))
    r = torch.where(exists, rewards.double()[:, None], torch.full(k.shape, float("nan"), dtype=torch.float64))
    keys = torch.stack([group_ids[:, None].expand_as(k).reshape(-1), reverse.reshape(-1)], dim=1)
    _, flat_keys = torch.unique(keys, dim=0, return_inverse=True)
    table = grpo_advantages(r.reshape(-1), flat_keys).advantages.view_as(r)
    key_size = torch.zeros(int(flat_keys.max()) + 1, dtype=torch.long).index_add_(
        0, flat_keys, torch.isfinite(r.reshape(-1)).long())[flat_keys].view_as(r)
    scorable_turn = exists & torch.isfinite(r)
    metrics = {"turn_credit/turns_mean": raw_turns.double().mean(),
               "turn_credit/unpaired_turn_frac": _masked_mean((key_size < 2).double(), scorable_turn)}
    return TurnCreditResult(_to_tokens(table, turn_index, model_mask), torch.ones_like(rewards, dtype=torch.bool),
                            metrics)


def compute_turn_credit(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, turn_index: torch.Tensor,
                        model_mask: torch.Tensor, values: torch.Tensor | None = None,
                        params: TurnCreditParams = TurnCreditParams()) -> TurnCreditResult:
    """The registered estimator `name` on the inputs of the module docstring, after checking their shapes and
    dtypes. Raises KeyError for an unknown name, ValueError for a bad input (naming it)."""
    fn = TURN_CREDIT.get(name)
    _check(rewards, group_ids, turn_index, model_mask, values)
    return fn(rewards, group_ids, turn_index, model_mask, values, params)
