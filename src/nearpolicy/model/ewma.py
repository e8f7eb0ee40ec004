"""The proximal-policy models the trainer keeps, chosen by `correction.proximal` (docs/math.md sec. 12): the
PPO-EWMA policy (a frozen copy holding the bias-corrected EWMA of the policy's weights, updated after every optimizer
step) and its checkpointing. Which log-probs the loss takes as its proximal (old, ewma, a3po; the engine's in
bypass mode) is decided in one place, ops/proximal.proximal_logprobs; this module only produces the EWMA
policy's log-probs that function is given."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.ops.proximal import PROXIMALS, ewma_update
from nearpolicy.model.policy import recompute_logprobs
from nearpolicy.types import SamplingParams

WEIGHT_SUM_KEY = "ewma.weight_sum"


class EwmaPolicy:
    """A frozen copy of the policy whose parameters are the bias-corrected EWMA of the policy's parameters:
    W' = decay W + 1, ewma' = (decay W / W') ewma + theta / W' (ops/proximal.ewma_update), started from the
    policy's current weights (W = 1). After k `update` calls from snapshots theta_1..theta_k it holds
    sum_j decay^(k-j) theta_j / sum_j decay^(k-j) over theta_0..theta_k. Buffers are copied, not averaged.
    Raises ValueError unless 0 <= decay < 1."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"EWMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.weight_sum = torch.ones((), dtype=torch.float64)

    def _pairs(self, model: torch.nn.Module):
        mine = dict(self.model.named_parameters())
        for name, theta in model.named_parameters():
            yield mine[name], theta

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """One EWMA step towards `model`'s current parameters (call after every optimizer step)."""
        new_sum = self.weight_sum
        for ewma, theta in self._pairs(model):  # coefficients from the float64 W, applied in the param dtype
            value, new_sum = ewma_update(ewma, theta.detach(), self.weight_sum, self.decay)
            ewma.copy_(value)
        self.weight_sum = new_sum

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, sampling: SamplingParams, micro: int) -> torch.Tensor:
        """Log-probs [B, T] float32 of the batch's completion ids under the EWMA weights (the loss's proximal
        log-probs when correction.proximal = "ewma")."""
        return recompute_logprobs(self.model, batch, sampling, micro)[0]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint: every EWMA parameter under "ewma.<name>" and the weight sum."""
        out = {f"ewma.{name}": p.detach().clone().contiguous() for name, p in self.model.named_parameters()}
        return out | {WEIGHT_SUM_KEY: self.weight_sum.clone()}

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore from `state_tensors` output. Raises ValueError when names or shapes do not match."""
        params = dict(self.model.named_parameters())
        names = {k.removeprefix("ewma.") for k in tensors if k != WEIGHT_SUM_KEY}
        if names != set(params) or WEIGHT_SUM_KEY not in tensors:
            raise ValueError(f"EWMA state does not match the model: {sorted(names ^ set(params))[:3]}")
        for name, p in params.items():
            p.copy_(tensors[f"ewma.{name}"])
        self.weight_sum = tensors[WEIGHT_SUM_KEY].to(torch.float64).clone()


def build_proximal_policy(kind: str, model: torch.nn.Module, decay: float) -> EwmaPolicy | None:
    """The EWMA model for kind "ewma", None otherwise (old and a3po need no model)."""
    if kind not in PROXIMALS:
        raise ValueError(f"unknown proximal policy {kind!r}; valid: {', '.join(PROXIMALS)}")
    return EwmaPolicy(model, decay) if kind == "ewma" else None


def restore_proximal(ewma: EwmaPolicy | None, extra: dict[str, torch.Tensor] | None, model: torch.nn.Module,
                     log=print, where: Path | str = "the checkpoint") -> None:
    """On --resume: load the EWMA weights and weight sum from a checkpoint's extra tensors (runs.folder.load_extra_tensors
    of the checkpoint `where`). A checkpoint written without them (before PPO-EWMA was selectable) restarts the
    average from the loaded `model` weights (W = 1), with a warning. Raises ValueError when the saved EWMA does not
    match the model."""
    if ewma is None:
        return
    state = {k: v for k, v in (extra or {}).items() if k.startswith("ewma.")}
    if state:
        ewma.load_state_tensors(state)
        return
    log(f"warning: checkpoint {where} holds no PPO-EWMA weights; the average restarts from its weights")
    fresh = EwmaPolicy(model, ewma.decay)
    ewma.model, ewma.weight_sum = fresh.model, fresh.weight_sum
