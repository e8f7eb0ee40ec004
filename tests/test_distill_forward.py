"""The forward-KL option of on-policy distillation (ops/distill.py, training/distillation.py, docs/math.md sec. 15):
KL(teacher || student) per position, exact over the vocabulary or over the teacher's top-k renormalised, masked by
selection, its gradient wrt the student's logits p_S - p_T; through policy_update it adds coef x the aggregated
forward KL to the loss; config refuses the combinations that cannot give what it needs. Values are written out by
hand or computed from the explicit formula in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.model.policy import recompute_logprobs
from nearpolicy.ops.corrections import CorrectionSpec
from nearpolicy.ops.distill import forward_kl_tokens, forward_kl_top_k_tokens, teacher_top_k
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.training.distillation import UpdateDistill
from nearpolicy.training.update import UpdateSettings, policy_update
from nearpolicy.types import Rollout, SamplingParams

DT = torch.float64


def _explicit_forward_kl(student_logits, teacher_logits, temperature=1.0):
    """sum_v p_T(v) (log p_T(v) - log p_S(v)), written out from softmax (no log_softmax), per row."""
    zs, zt = student_logits / temperature, teacher_logits / temperature
    p_s = torch.exp(zs) / torch.exp(zs).sum(-1, keepdim=True)
    p_t = torch.exp(zt) / torch.exp(zt).sum(-1, keepdim=True)
    return (p_t * (torch.log(p_t) - torch.log(p_s))).sum(-1)


def test_a_hand_made_distribution():
    # teacher p_T = (1/2, 1/4, 1/4), student uniform over 3: KL = 1/2 ln(3/2) + 2 x 1/4 ln(3/4) = ln 3 - 1.5 ln 2
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=DT))
    student = torch.zeros(1, 3, dtype=DT, requires_grad=True)
    kl = forward_kl_tokens(student, teacher, torch.tensor([True]))
    assert kl.item() == pytest.approx(math.log(3) - 1.5 * math.log(2), rel=1e-14)
    (grad,) = torch.autograd.grad(kl.sum(), student)
    assert torch.allclose(grad, torch.tensor([[1 / 3 - 0.5, 1 / 3 - 0.25, 1 / 3 - 0.25]], dtype=DT), rtol=0, atol=1e-15)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_value_and_gradient_match_the_explicit_formula(temperature):
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(3, 4, 7, generator=g, dtype=DT) * 2).requires_grad_(True)
    teacher = torch.randn(3, 4, 7, generator=g, dtype=DT) * 2
    mask = torch.rand(3, 4, generator=g) > 0.3
    kl = forward_kl_tokens(student, teacher, mask, temperature)
    ref = torch.where(mask, _explicit_forward_kl(student.detach(), teacher, temperature), 0.0)
    assert torch.allclose(kl.detach(), ref, rtol=1e-13, atol=1e-15)
    weights = torch.randn(3, 4, generator=g, dtype=DT)
    (grad,) = torch.autograd.grad((kl * weights).sum(), student)
    explicit = student.detach().clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad((torch.where(mask, _explicit_forward_kl(explicit, teacher, temperature), 0.0)
                                       * weights).sum(), explicit)
    p_s = torch.softmax(student.detach() / temperature, -1)
    p_t = torch.softmax(teacher / temperature, -1)
    by_hand = torch.where(mask[..., None], weights[..., None] * (p_s - p_t) / temperature, 0.0)
    assert torch.allclose(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert torch.allclose(grad, by_hand, rtol=1e-12, atol=1e-15)
    assert torch.autograd.gradcheck(lambda s: forward_kl_tokens(s, teacher, mask, temperature), (student,))


def test_the_teacher_gets_no_gradient_and_identical_distributions_give_zero():
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(2, 5, 9, generator=g, dtype=DT, requires_grad=True)
    student = torch.randn(2, 5, 9, generator=g, dtype=DT, requires_grad=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    forward_kl_tokens(student, teacher, mask).sum().backward()
    assert teacher.grad is None and student.grad is not None
    same = forward_kl_tokens(teacher.detach() + 3.0, teacher.detach(), mask)  # a shift of the logits: same p
    assert torch.allclose(same, torch.zeros(2, 5, dtype=DT), atol=1e-14)


def test_masked_positions_contribute_nothing_even_when_nan():
    g = torch.Generator().manual_seed(2)
    student = torch.randn(2, 6, 5, generator=g, dtype=DT)
    teacher = torch.randn(2, 6, 5, generator=g, dtype=DT)
    mask = torch.tensor([[True, True, False, True, False, False], [False, True, True, True, True, False]])
    clean = forward_kl_tokens(student, teacher, mask)
    poisoned_s = student.masked_fill(~mask[..., None], float("nan")).requires_grad_(True)
    poisoned_t = teacher.masked_fill(~mask[..., None], float("inf"))
    kl = forward_kl_tokens(poisoned_s, poisoned_t, mask)
    assert torch.equal(kl, clean) and torch.equal(kl[~mask], torch.zeros(int((~mask).sum()), dtype=DT))
    kl.sum().backward()
    assert torch.isfinite(poisoned_s.grad).all()
    assert torch.equal(poisoned_s.grad[~mask], torch.zeros_like(poisoned_s.grad[~mask]))
    ids = torch.zeros(2, 6, 2, dtype=torch.long)
    top_logprobs = torch.full((2, 6, 2), float("nan"), dtype=DT).masked_fill(mask[..., None], -1.0)
    top = forward_kl_top_k_tokens(poisoned_s, top_logprobs, ids, mask)
    assert torch.equal(top[~mask], torch.zeros(int((~mask).sum()), dtype=DT)) and torch.isfinite(top).all()


def test_top_k_equals_the_full_form_at_k_equal_v():
    g = torch.Generator().manual_seed(3)
    student = torch.randn(4, 3, 11, generator=g, dtype=DT, requires_grad=True)
    teacher = torch.randn(4, 3, 11, generator=g, dtype=DT)
    mask = torch.rand(4, 3, generator=g) > 0.2
    full = forward_kl_tokens(student, teacher, mask, 0.9)
    top, ids = teacher_top_k(teacher, 11, 0.9)
    approx = forward_kl_top_k_tokens(student, top, ids, mask, 0.9)
    assert torch.allclose(approx, full, rtol=1e-12, atol=1e-15)
    (g_full,) = torch.autograd.grad(full.sum(), student)
    (g_top,) = torch.autograd.grad(forward_kl_top_k_tokens(student, top, ids, mask, 0.9).sum(), student)
    assert torch.allclose(g_top, g_full, rtol=1e-12, atol=1e-15)
    assert torch.equal(teacher_top_k(teacher, 50)[1], teacher_top_k(teacher, 11)[1])  # k > V: the whole vocabulary


def test_top_k_is_the_renormalised_teacher_by_hand():
    # teacher (0.5, 0.3, 0.2), k = 2: q = (5/8, 3/8) on tokens 0, 1; student (0.25, 0.25, 0.5):
    # KL_k = 5/8 ln((5/8)/(1/4)) + 3/8 ln((3/8)/(1/4));
    # gradient wrt the student logits p_S - q = (1/4 - 5/8, 1/4 - 3/8, 1/2)
    teacher = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=DT))
    student = torch.log(torch.tensor([[0.25, 0.25, 0.5]], dtype=DT)).requires_grad_(True)
    top, ids = teacher_top_k(teacher, 2)
    assert ids.tolist() == [[0, 1]]
    kl = forward_kl_top_k_tokens(student, top, ids, torch.tensor([True]))
    assert kl.item() == pytest.approx(5 / 8 * math.log(2.5) + 3 / 8 * math.log(1.5), rel=1e-14)
    (grad,) = torch.autograd.grad(kl.sum(), student)
    assert torch.allclose(grad, torch.tensor([[0.25 - 0.625, 0.25 - 0.375, 0.5]], dtype=DT), rtol=0, atol=1e-15)
    # the engine-style input: unnormalised top-k log-probs give the same value (only differences within k count)
    shifted = forward_kl_top_k_tokens(student, top - 7.0, ids, torch.tensor([True]))
    assert shifted.item() == pytest.approx(kl.item(), rel=1e-14)


def test_the_direction_matters():
    """The defining step: KL(teacher || student), not KL(student || teacher). On the hand-made pair the reverse
    direction is 1/3 ln((1/3)/(1/2)) + 2/3 ln((1/3)/(1/4)), a different number from ln 3 - 1.5 ln 2."""
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=DT))
    student = torch.zeros(1, 3, dtype=DT)
    forward = forward_kl_tokens(student, teacher, torch.tensor([True])).item()
    reverse = forward_kl_tokens(teacher, student, torch.tensor([True])).item()  # swapped: KL(student || teacher)
    assert reverse == pytest.approx(1 / 3 * math.log(2 / 3) + 2 / 3 * math.log(4 / 3), rel=1e-14)
    assert forward == pytest.approx(math.log(3) - 1.5 * math.log(2), rel=1e-14)
    assert abs(forward - reverse) > 1e-3


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        forward_kl_tokens(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        forward_kl_tokens(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match="k >= 1"):
        teacher_top_k(torch.zeros(2, 3), 0)


# -- through policy_update ----------------------------------------------------------------------------------------
SAMPLING = SamplingParams(0.9, 1.0, 0, 8)


@pytest.fixture(scope="module")
def models_and_batch(tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_CONFIG
    from nearpolicy.model.load import load_policy

    student = load_policy(str(tiny_model_dir))[0]
    torch.manual_seed(7)
    teacher = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).float().eval().requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    rollouts = []
    for i in range(4):
        prompt = torch.randint(3, 49152, (3 + i % 2,), generator=g).tolist()
        ids = torch.randint(3, 49152, (4 + i,), generator=g).tolist()
        rollouts.append(Rollout(i // 2, i % 2, prompt, ids, [-9.0] * len(ids), [0] * len(ids), "stop"))
    return student, teacher, collate(rollouts, 2, 49152)


def _update(student, teacher, batch, micro: int, top_k: int = 0, coef: float = 0.5, advantages=None):
    model = copy.deepcopy(student)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = {}
    optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    old = recompute_logprobs(model, batch, SAMPLING, 4)[0]
    settings = UpdateSettings(1, micro, 1e9, "ppo_clip", PolicyLossParams(0.2, 0.28, 3.0), "token-mean", None,
                              CorrectionSpec())
    advantages = torch.zeros(4) if advantages is None else advantages
    distill = UpdateDistill(teacher, coef, top_k)
    return policy_update(model, optimizer, batch, old, advantages, SAMPLING, settings, distill=distill).metrics, grads


def _forward_kl_of_models(student, teacher, batch) -> torch.Tensor:
    """The token-mean forward KL over the batch's response tokens, from the two models' full logits (float64)."""
    with torch.no_grad():
        def at(model):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
            return torch.gather(logits, 1, batch.logit_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        kl = _explicit_forward_kl(at(student), at(teacher), SAMPLING.temperature)
    return kl[batch.mask].mean()


def test_the_update_adds_coef_times_the_forward_kl(models_and_batch):
    student, teacher, batch = models_and_batch
    metrics, grads = _update(student, teacher, batch, 4)
    expected = float(_forward_kl_of_models(student, teacher, batch))
    assert expected > 0.5  # two random tiny models
    assert metrics["distill/forward_kl"] == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/loss"] == pytest.approx(0.5 * expected, rel=1e-5)  # advantages 0: the policy term is 0
    assert metrics["actor/inert_rows"] == 0.0  # the forward KL reaches every row
    assert float(grads["model.embed_tokens.weight"].norm()) > 0
    split, split_grads = _update(student, teacher, batch, 1)  # micro-batches sum to the mini-batch's token mean
    assert split["distill/forward_kl"] == pytest.approx(metrics["distill/forward_kl"], rel=1e-5)
    for name, g in grads.items():  # float32 sums over the tied 49152-row embedding: 1e-4 relative
        assert float((split_grads[name] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-12, name


def test_a_teacher_equal_to_the_student_gives_zero_and_no_gradient(models_and_batch):
    student, _, batch = models_and_batch
    metrics, grads = _update(student, copy.deepcopy(student).requires_grad_(False), batch, 2)
    assert abs(metrics["distill/forward_kl"]) < 1e-6
    assert max(float(g.abs().max()) for g in grads.values()) < 1e-6


def test_top_k_in_the_update_is_close_to_and_not_the_exact_form(models_and_batch):
    student, teacher, batch = models_and_batch
    exact, _ = _update(student, teacher, batch, 4)
    whole, _ = _update(student, teacher, batch, 4, top_k=49152)
    top, _ = _update(student, teacher, batch, 4, top_k=64)
    assert whole["distill/forward_kl"] == pytest.approx(exact["distill/forward_kl"], rel=1e-5)
    assert top["distill/forward_kl"] != pytest.approx(exact["distill/forward_kl"], rel=1e-3)


# -- config ---------------------------------------------------------------------------------------------------------
def test_config_refuses_what_the_divergence_cannot_get():
    base = ["distill.teacher=smollm2", "distill.divergence=forward", "sampling.top_k=0", "sampling.top_p=1.0"]
    cfg = load_config(None, base + ["distill.forward_top_k=20"])
    assert (cfg.distill.divergence, cfg.distill.forward_top_k) == ("forward", 20)
    assert load_config(None, []).distill.divergence == "reverse"
    cases = [(base[:2] + ["sampling.top_k=20"], "sampling.top_k"),
             (base[:2] + ["sampling.top_k=0", "sampling.top_p=0.9"], "sampling.top_p"),
             (["distill.divergence=forward"], "distill.teacher"),
             (["distill.teacher=smollm2", "distill.forward_top_k=5"], "distill.divergence = 'forward'"),
             (base + ["episode.enabled=true", "algorithm.observation_loss_coef=0.1"], "observation_loss_coef")]
    for sets, named in cases:
        with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("'", ".")):
            load_config(None, sets)


def test_a_forward_kl_step_is_not_reported_as_training_on_nothing():
    from nearpolicy.training.guards import no_signal

    assert no_signal({"advantage/nonzero_frac": 0.0}) is not None
    assert no_signal({"advantage/nonzero_frac": 0.0, "distill/forward_kl": 1.3}) is None


def test_a_teacher_of_another_vocabulary_is_refused_by_the_dry_run(tiny_model_dir, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from nearpolicy.training.assemble import dry_plan

    other = LlamaConfig.from_pretrained(tiny_model_dir)
    other.vocab_size = 512
    LlamaForCausalLM(other).save_pretrained(tmp_path / "teacher")
    cfg = load_config(None, [f"model.path='{tiny_model_dir}'", f"distill.teacher='{tmp_path / 'teacher'}'",
                             "distill.coef=1.0"])
    with pytest.raises(ValueError, match=r"distill\.teacher: the teacher .* has 512 tokens in its vocabulary and the "
                                         r"policy .* 49152: distillation needs the policy's tokenizer"):
        dry_plan(cfg)
    dry_plan(load_config(None, [f"model.path='{tiny_model_dir}'", f"distill.teacher='{tiny_model_dir}'",
                                "distill.coef=1.0"]))  # the same vocabulary passes
    missing = load_config(None, [f"model.path='{tiny_model_dir}'", f"distill.teacher='{tmp_path / 'nope'}'"])
    with pytest.raises(ValueError, match=r"^distill\.teacher '[^']*nope' does not exist; .* a run's `nearpolicy export"):
        dry_plan(missing)
    (tmp_path / "empty").mkdir()
    no_config = load_config(None, [f"model.path='{tiny_model_dir}'", f"distill.teacher='{tmp_path / 'empty'}'"])
    with pytest.raises(ValueError, match=r"^distill\.teacher '[^']*empty' is a folder without config\.json"):
        dry_plan(no_config)


def test_a_teacher_whose_weights_cannot_load_is_named_once_at_load(tiny_model_dir, tmp_path) -> None:
    import shutil

    from nearpolicy.training.assemble import _load_teacher

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # passes the dry run: config.json is there
    cfg = load_config(None, [f"model.path='{tiny_model_dir}'", f"distill.teacher='{broken}'", "distill.coef=1.0"])
    with pytest.raises(ValueError, match=rf"^distill\.teacher '{broken}': cannot load the model from {broken} "):
        _load_teacher(cfg, tokenizer=None, log=lambda _: None)
