"""The gradient-bias instrument (nearpolicy/gradbias): the estimator against exact expectations on an enumerable
one-token policy, the sketch, and the per-correction gradient against policy_update's own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.engines.fake import TiltedEngine
from nearpolicy.gradbias.estimate import Grams, cell_estimates, point_statistics
from nearpolicy.gradbias.measure import SampledBatch, batch_gradients
from nearpolicy.gradbias.sketch import GradientSketch
from nearpolicy.ops.advantages import compute_advantages
from nearpolicy.ops.correction_presets import correction_spec
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.training.update import UpdateSettings, policy_update
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

VOCAB = 6
REWARD = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.2])  # r(y) of the one-token response y
TILT = np.array([1.2, -0.8, 0.0, 0.6, -1.0, 0.3])  # log mu - log pi up to a constant
SAMPLING = SamplingParams(1.0, 1.0, 0, 1)


def tiny_model(seed: int = 0, vocab: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).float()


def settings(preset: str, proximal: str = "old", **loss) -> UpdateSettings:
    return UpdateSettings(1, 8, math.inf, "ppo_clip", PolicyLossParams(**loss), "token-mean", None,
                          correction_spec(preset), proximal=proximal)


ARMS = {"off": settings("off"), "token_is": settings("token_is"), "tis": settings("tis")}


def sample(engine, seed: int, groups: int = 8, n: int = 8, prompt=(1,)) -> SampledBatch:
    """A batch of `groups` x `n` one-token responses, reward REWARD[y], advantage = reward ("reinforce")."""
    requests = [GenerationRequest(g, tuple(prompt), n) for g in range(groups)]
    rollouts = engine.generate(requests, SAMPLING, seed)
    for r in rollouts:
        r.reward = float(REWARD[r.completion_ids[0]])
    batch = collate(rollouts, 0, VOCAB, shared_prompt=False)
    rewards = torch.tensor([r.reward for r in rollouts])
    adv = compute_advantages("reinforce", rewards, torch.tensor([r.group_id for r in rollouts]))
    return SampledBatch(rollouts, batch, adv.advantages.float(), torch.ones(len(rollouts), dtype=torch.bool))


def exact_gradients(model, prompt=(1,)) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Exact expected gradients of the token-mean loss -w r(y) log pi(y) under y ~ mu, by enumerating y, computed
    here by plain autograd (not through the library): g* (y ~ pi, w = 1), off (y ~ mu, w = 1), token_is
    (w = pi / mu), tis (w = min(pi / mu, 2)). Returns (by name, pi, mu)."""
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(torch.tensor([list(prompt)])).logits[0, -1].double()
    logpi = torch.log_softmax(logits, -1)
    pi = logpi.exp().detach().numpy()
    s = logits.detach().numpy() + TILT
    mu = np.exp(s - s.max())
    mu /= mu.sum()
    per_y = []
    for y in range(VOCAB):
        grads = torch.autograd.grad(logpi[y], params, retain_graph=True, allow_unused=True)
        per_y.append(torch.cat([torch.zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(params, grads)]
                               ).double().numpy())
    per_y = np.stack(per_y)
    weigh = lambda q, w: -(q * w * REWARD) @ per_y  # noqa: E731
    ratio = pi / mu
    return ({"g*": weigh(pi, 1.0), "off": weigh(mu, 1.0), "token_is": weigh(mu, ratio),
             "tis": weigh(mu, np.minimum(ratio, 2.0))}, pi, mu)


def replicates(model, source, reference, n: int, arms=ARMS):
    sketch = GradientSketch(list(model.parameters()), dim=None)
    x, ys = [], {a: [] for a in arms}
    for i in range(n):
        ref = batch_gradients(model, sketch, sample(reference, 10_000 + i), SAMPLING, {"off": arms["off"]}, 0, 8)
        x.append(ref.sketches["off"])
        got = batch_gradients(model, sketch, sample(source, i), SAMPLING, arms, 0, 8)
        for a in arms:
            ys[a].append(got.sketches[a])
    return np.stack(x), {a: np.stack(v) for a, v in ys.items()}


def grams(x: np.ndarray, y: np.ndarray) -> Grams:
    return Grams(x @ x.T, y @ y.T, y @ x.T)


@pytest.fixture(scope="module")
def measured():
    model = tiny_model()
    exact, pi, mu = exact_gradients(model)
    x, ys = replicates(model, TiltedEngine(model, TILT), TiltedEngine(model, np.zeros(VOCAB)), 120)
    return model, exact, x, ys


def test_the_exact_values_are_what_the_test_expects(measured):
    """The setup is informative: the tilt biases the uncorrected gradient by far more than the instrument's noise,
    and token IS is unbiased in exact arithmetic (the check the instrument must reproduce)."""
    _, exact, _, _ = measured
    g = exact["g*"]
    assert np.linalg.norm(exact["off"] - g) / np.linalg.norm(g) > 0.3
    assert np.linalg.norm(exact["token_is"] - g) / np.linalg.norm(g) < 1e-9


def test_mean_gradients_match_the_exact_expectations(measured):
    """Each arm's mean sketch (full gradient here) equals its exact expectation within 4 standard errors, per
    coordinate, on the largest coordinates."""
    _, exact, x, ys = measured
    for name, samples in [("g*", x), *((a, ys[a]) for a in ARMS)]:
        target = exact["g*" if name == "g*" else name]
        se = samples.std(0, ddof=1) / math.sqrt(len(samples))
        top = np.argsort(-np.abs(target))[:20]
        z = (samples.mean(0)[top] - target[top]) / se[top]
        assert np.max(np.abs(z)) < 4.5, (name, z)


def test_the_uncorrected_bias_is_measured_at_its_exact_value(measured):
    _, exact, x, ys = measured
    true_rel2 = np.sum((exact["off"] - exact["g*"]) ** 2) / np.sum(exact["g*"] ** 2)
    est = cell_estimates(grams(x, ys["off"]))["rel_bias2"]
    assert est.low <= true_rel2 <= est.high, (est, true_rel2)
    assert est.excludes_zero
    tis_true = np.sum((exact["tis"] - exact["g*"]) ** 2) / np.sum(exact["g*"] ** 2)
    tis = cell_estimates(grams(x, ys["tis"]))["rel_bias2"]
    assert tis.low <= tis_true <= tis.high, (tis, tis_true)


def test_token_is_is_measured_unbiased(measured):
    """Token IS removes the tilt's bias: its interval holds 0 (and the uncorrected one's does not, above)."""
    _, _, x, ys = measured
    est = cell_estimates(grams(x, ys["token_is"]))["rel_bias2"]
    assert est.low <= 0 <= est.high, est


def test_the_null_source_has_no_measured_bias():
    """The reference's own engine, other seeds: bias 0 within the interval."""
    model = tiny_model(1)
    same = TiltedEngine(model, np.zeros(VOCAB))
    x, ys = replicates(model, same, TiltedEngine(model, np.zeros(VOCAB)), 60, {"off": ARMS["off"]})
    est = cell_estimates(grams(x, ys["off"]))["rel_bias2"]
    assert est.low <= 0 <= est.high, est


def test_the_check_fails_when_the_weight_is_left_out(measured, monkeypatch):
    """Break the estimator (token IS computed without its weight): the unbiasedness check above no longer holds."""
    import nearpolicy.gradbias.coefficients as coefficients

    model, _, _, _ = measured
    real = coefficients.mismatch_correction

    def unweighted(*args, **kwargs):
        out = real(*args, **kwargs)
        return type(out)(torch.ones_like(out.weights), out.keep, out.metrics)

    monkeypatch.setattr(coefficients, "mismatch_correction", unweighted)
    x, ys = replicates(model, TiltedEngine(model, TILT), TiltedEngine(model, np.zeros(VOCAB)), 60,
                       {"off": ARMS["off"], "token_is": ARMS["token_is"]})
    est = cell_estimates(grams(x, ys["token_is"]))["rel_bias2"]
    assert est.low > 0, est


def test_the_debiasing_removes_the_noise_term():
    """Synthetic replicates with a known mean difference: the debiased bias^2 is unbiased over repetitions, while
    the plug-in ||mean difference||^2 is high by tr(Var) / N."""
    rng = np.random.default_rng(0)
    dim, n, true = 400, 10, np.zeros(400)
    true[:5] = 0.3  # ||bias||^2 = 0.45; ||g*||^2 = 400 * 0.25 = 100 with g* = 0.5
    ours, plug = [], []
    for _ in range(300):
        x = 0.5 + rng.standard_normal((n, dim))
        y = 0.5 + true + rng.standard_normal((n, dim))
        g = grams(x, y)
        ours.append(point_statistics(g)["bias2"])
        d = (y - x).mean(0)
        plug.append(d @ d)
    assert abs(np.mean(ours) - 0.45) < 4 * np.std(ours) / math.sqrt(len(ours))
    assert np.mean(plug) > 0.45 + 0.9 * 2 * dim / n  # tr Var_D / N = 2 * 400 / 10 = 80


def test_the_sketch_keeps_inner_products():
    """Count-sketch of dimension m: <s(a), s(b)> within 5 sd (sd <= sqrt(2 / m) ||a|| ||b||) of <a, b>; dim None
    is the full gradient."""
    model = tiny_model()
    params = list(model.parameters())
    rng = torch.Generator().manual_seed(3)
    a = [torch.randn(p.shape, generator=rng) for p in params]
    b = [x + 0.5 * torch.randn(x.shape, generator=rng) for x in a]
    full = GradientSketch(params, dim=None)
    fa, fb = full(a), full(b)
    assert fa.shape == (sum(p.numel() for p in params),)
    sketch = GradientSketch(params, dim=512, seed=1)
    sa, sb = sketch(a), sketch(b)
    sd = math.sqrt(2 / 512) * np.linalg.norm(fa) * np.linalg.norm(fb)
    assert abs(sa @ sb - fa @ fb) < 5 * sd
    assert abs(sa @ sb - fa @ fb) > 0  # a sketch, not a copy
    assert sketch.distortion == pytest.approx(math.sqrt(2 / 512), rel=0, abs=1e-12)


def _random_batch(stale: bool):
    """Two groups of four 3-token responses with a hand-made engine mismatch (a third of the tokens far off)."""
    rng = np.random.default_rng(5)
    rollouts = []
    for g in range(2):
        for i in range(4):
            ids = [int(t) for t in rng.integers(0, 16, 3)]
            lps = [float(v) for v in -2.5 + rng.normal(0, 0.8, 3)]
            rollouts.append(Rollout(g, i, [1, 2 + g], ids, lps, [0 if stale else 3] * 3, "length",
                                    reward=float(rng.random() < 0.5)))
    return rollouts


@pytest.mark.parametrize("preset,proximal", [("off", "old"), ("tis", "old"), ("seq_tis", "old"),
                                             ("geo_rs", "old"), ("tis_snis", "old"), ("token_is", "a3po"),
                                             ("bypass_ppo_clip", "old"), ("k3_rs", "old"), ("icepop", "old")])
def test_the_gradient_is_policy_updates_own(preset, proximal):
    """coefficients + one backward per correction gives the gradient policy_update steps on (captured by an
    optimizer that records instead of stepping), for corrections of every kind: token, sequence, rejection,
    self-normalised (batch statistics), bypass (the PPO clip acts), A-3PO on stale tokens."""
    model = tiny_model(2, vocab=16)
    rollouts = _random_batch(stale=proximal == "a3po")
    batch = collate(rollouts, 0, 16, shared_prompt=False)
    adv = compute_advantages("grpo", torch.tensor([r.reward for r in rollouts]),
                             torch.tensor([r.group_id for r in rollouts])).advantages.float()
    arm = settings(preset, proximal)
    keep = torch.ones(len(rollouts), dtype=torch.bool)
    params = list(model.parameters())
    sketch = GradientSketch(params, dim=None)
    ours = batch_gradients(model, sketch, SampledBatch(rollouts, batch, adv, keep), SAMPLING_3,
                           {"off": settings("off"), preset: arm}, 3, 4).sketches[preset]

    class Tap(torch.optim.Optimizer):
        def __init__(self):
            super().__init__(params, {})
            self.seen = None

        def step(self, closure=None):
            self.seen = sketch()

    tap = Tap()
    from nearpolicy.model.policy import recompute_logprobs

    old, _ = recompute_logprobs(model, batch, SAMPLING_3, 4)
    policy_update(model, tap, batch, old, adv, SAMPLING_3, arm, sample_keep=keep, version=3)
    if preset not in ("geo_rs", "k3_rs"):  # these reject every sequence of this far-off batch: both are 0
        assert np.linalg.norm(tap.seen) > 0
    np.testing.assert_allclose(ours, tap.seen, rtol=1e-4, atol=1e-6 * np.abs(tap.seen).max())


SAMPLING_3 = SamplingParams(1.0, 1.0, 0, 3)


def test_the_shift_between_two_corrections_is_paired_and_tight():
    """Two corrections on the same noisy batches, one moved by a known vector: the paired shift recovers its norm
    (relative to ||g*||) within a tight interval although each batch's noise is 50x the shift."""
    from nearpolicy.gradbias.estimate import relative_shift

    rng = np.random.default_rng(1)
    n, dim = 12, 300
    g_star = np.full(dim, 0.2)  # ||g*|| = 0.2 sqrt(300) = 3.46
    move = np.zeros(dim)
    move[:3] = 0.2  # ||move|| = 0.346: 10 % of ||g*||
    x = g_star + 0.3 * rng.standard_normal((n, dim))  # the reference (its noise sets ||g*||^2's precision)
    base = g_star + rng.standard_normal((n, dim))  # correction A on the source's batches
    other = base + move + 0.01 * rng.standard_normal((n, dim))  # correction B: the same batches, moved
    est = relative_shift(x @ x.T, Grams(base @ base.T, other @ other.T, other @ base.T))
    assert est.low <= 0.1 <= est.high and est.high - est.low < 0.04, est  # width: mostly ||g*||^2 own noise


def test_the_jackknife_interval_covers_a_zero_bias_at_ten_replicates():
    """Ten replicates of heavy-tailed, low-rank noise (a few directions carry most of it, as in a policy gradient;
    tr Var about 10 ||g*||^2 per batch, as docs/gradbias.md measured), no bias: the 95 % interval of bias^2 holds 0 in at least 90 % of 300 repetitions (the percentile bootstrap held
    it in far fewer on the main model, docs/gradbias.md)."""
    rng = np.random.default_rng(7)
    dim, n, rank = 200, 10, 6
    basis = 0.2 * rng.standard_normal((rank, dim))  # one batch's noise: about 10 x ||g*||^2, as measured
    g_star = np.full(dim, 0.3)
    covered = 0
    for _ in range(300):
        draw = lambda: g_star + rng.standard_t(3, (n, rank)) @ basis + 0.3 * rng.standard_normal((n, dim))  # noqa: E731
        est = cell_estimates(grams(draw(), draw()))["rel_bias2"]
        covered += est.low <= 0 <= est.high
    assert covered >= 270, covered
