"""What on-policy distillation adds inside the policy update (training/update.policy_update), built by
training/assemble.py into Session.distill: the forward-KL loss term against the in-process teacher's logits
(distill.divergence = "forward"; ops/distill.py) and R-OPD's gradient probe (distill.ropd; ops/ropd.py, its switch in
rollouts/curriculum.py). docs/math.md sec. 15.

The teacher is always an in-process torch model here (training/assemble._load_teacher: an HF folder or a GGUF read
into torch), so its full logits are available and distill.forward_top_k = 0 uses the exact form. forward_top_k = k
keeps only the teacher's top-k log-probs, renormalised: the form an engine teacher (top-k log-probs only) would
allow, run here from the same logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.model.policy import completion_logits, head_in_fp32
from nearpolicy.ops.distill import forward_kl_tokens, forward_kl_top_k_tokens, teacher_top_k
from nearpolicy.ops.logprobs import token_logprobs_and_entropy
from nearpolicy.types import SamplingParams


class GradientProbe:
    """R-OPD's per-micro-batch gradient estimates on d fixed coordinates of the flattened gradient of `params`
    (those with requires_grad, in order): every coordinate when there are at most `size`, else `size` drawn
    uniformly with replacement from a torch.Generator seeded by `seed` (the same at every step; squared norms scale
    by D / d in expectation, a factor the trigger's comparison cancels). `record()` after each micro-batch's
    backward of an update's first mini-batch reads the accumulated gradient there; `take()` returns the estimates
    x_j = m (G_j - G_{j-1}) [m, d] float64 (m micro-batches, G_j the accumulated gradient after micro-batch j: each
    x_j is micro-batch j's gradient scaled to the mini-batch, exact when the micro-batches carry equal shares of
    the loss's denominator) and starts over."""

    def __init__(self, params, size: int, seed: int = 0):
        params = [p for p in params if p.requires_grad]
        sizes = torch.tensor([p.numel() for p in params])
        total = int(sizes.sum())
        if total <= size:
            chosen = torch.arange(total)
        else:
            chosen = torch.randint(total, (size,), generator=torch.Generator().manual_seed(seed)).sort().values
        ends = torch.cumsum(sizes, 0)
        owner = torch.bucketize(chosen, ends, right=True)  # the parameter each chosen coordinate belongs to
        self.index = [(p, chosen[owner == i] - (ends[i] - sizes[i])) for i, p in enumerate(params)
                      if bool((owner == i).any())]
        self.parts: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def read(self) -> torch.Tensor:
        """The accumulated gradient [d] float64 at the chosen coordinates (0 where a parameter has no grad)."""
        return torch.cat([p.grad.detach().reshape(-1)[i].double() if p.grad is not None
                          else torch.zeros(len(i), dtype=torch.float64) for p, i in self.index])

    def record(self) -> None:
        now = self.read()
        self.parts.append(now if self.last is None else now - self.last)
        self.last = now

    def take(self) -> torch.Tensor:
        parts, self.parts, self.last = self.parts, [], None
        if not parts:
            return torch.zeros((0, sum(len(i) for _, i in self.index)), dtype=torch.float64)
        return torch.stack(parts) * len(parts)


@dataclass(frozen=True)
class UpdateDistill:
    """Session.distill: teacher, the frozen teacher whose logits the forward KL needs (None: no forward-KL term);
    coef, its weight (distill.coef); top_k, 0 for the exact full-vocabulary form, else the teacher's top-k
    (distill.forward_top_k); probe, R-OPD's GradientProbe (None: distill.ropd off)."""

    teacher: torch.nn.Module | None = None
    coef: float = 1.0
    top_k: int = 0
    probe: GradientProbe | None = None

    @property
    def forward(self) -> bool:
        return self.teacher is not None


def forward_kl_pass(model: torch.nn.Module, micro: TokenBatch, sampling: SamplingParams, entropy_grad: bool,
                    distill: UpdateDistill, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward of the policy over a micro-batch that also gives the forward KL to distill.teacher: (logprobs
    [b, T] and entropy [b, T] as model.policy.sequence_logprobs gives them; fkl [b, T], nats, with grad through the
    student's logits only: KL(teacher || student) under log_softmax(logits / sampling.temperature) at the `mask`
    [b, T] bool positions, 0 elsewhere; exact, or the top-k form with distill.top_k). The teacher runs under no_grad
    on the same positions. config refuses the forward KL with sampling.top_k / top_p (the student's sampling
    distribution is 0 outside its kept set, so the divergence would be infinite)."""
    logits, valid = completion_logits(model, micro)
    with head_in_fp32():  # under trainer_precision bf16: the head's arithmetic and the teacher as phases scores it
        picked, entropy = token_logprobs_and_entropy(logits, micro.completion_ids[valid], sampling.temperature,
                                                     sampling.top_k, sampling.top_p, entropy_grad)
        with torch.no_grad():
            teacher_logits = completion_logits(distill.teacher, micro)[0]
        keep = mask.bool()[valid]  # the loss's positions among the logits' rows
        if distill.top_k:
            top, ids = teacher_top_k(teacher_logits, distill.top_k, sampling.temperature)
            at_valid = forward_kl_top_k_tokens(logits, top, ids, keep, sampling.temperature)
        else:
            at_valid = forward_kl_tokens(logits, teacher_logits, keep, sampling.temperature)
    return _scatter(picked, valid), _scatter(entropy, valid), _scatter(at_valid, valid)


def _scatter(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """values [n] at the True positions of valid [B, T], 0 elsewhere (differentiable)."""
    return torch.zeros(valid.shape, dtype=values.dtype).masked_scatter(valid, values)
