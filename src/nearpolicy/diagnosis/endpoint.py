"""`nearpolicy diagnose --endpoint URL`: the training-inference mismatch of a running OpenAI-compatible server,
measured against the trainer's model on the same token ids, with the same table and admission budget as
`nearpolicy diagnose` (docs/diagnose.md).

The engine (mu) is the server: it samples `prompts x group` completions of the config's task prompts, each its own
seeded request, with per-token log-probs and its top-k log-probs (diagnosis/endpoint_client.py). The reference (pi)
is the trainer's fp32 model (model.path, `--weights` on top), run through the trainer's own log-prob path
(model/policy.completion_logits, ops/logprobs.token_logprobs_and_entropy) on exactly the ids the server sampled
(diagnosis/endpoint_tokens.py). Every ratio is r = pi / mu on tokens sampled from mu; k1 / k3 estimate KL(mu || pi)
in nats per token (diagnosis/measure.summarise, ops/diagnostics.py).

Which log-prob the server reports (`logprobs_mode`): "raw", log softmax of the model's logits before any sampling
transform (the OpenAI convention, vLLM's default, llama-cpp-python's only kind): the reference is scored raw too.
"processed", the log-prob under the sampling transform (vLLM `--logprobs-mode processed_logprobs`): the reference
is scored under the claimed transform (temperature, top-k, top-p). At temperature 1 without top-k / top-p the two
agree. Whatever the mode, the sampler itself is checked from the sampled tokens (diagnosis/endpoint_report.py):
the temperature they were drawn at, and whether each lies inside the support the claimed top-k / top-p allows.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from nearpolicy.batching import collate
from nearpolicy.diagnosis.endpoint_client import ENGINE_ZERO, EndpointClient, EndpointError, SampleRequest
from nearpolicy.diagnosis.endpoint_report import checks, endpoint_report, retokenization_row
from nearpolicy.diagnosis.endpoint_tokens import ResolvedSample, TokenIdentity, resolve, retokenize
from nearpolicy.diagnosis.measure import DiagnoseContext, summarise
from nearpolicy.diagnosis.run import DiagnoseSettings
from nearpolicy.model.load import pad_token_id, stop_token_ids
from nearpolicy.model.policy import completion_logits, recompute_logprobs, trainer_compute
from nearpolicy.ops.distribution_checks import TEMPERATURE_GRID, support_replay, temperature_fit_stats, topk_bounds
from nearpolicy.ops.logprobs import token_logprobs_and_entropy, transformed_log_softmax
from nearpolicy.types import Rollout, SamplingParams

LOGPROBS_MODES = ("raw", "processed")
MIN_COVERAGE = 0.9  # fewer completions with recoverable ids, or sampled tokens with a finite log-prob, than this
#                    fraction: no verdict (EndpointError)


@dataclass
class EndpointSettings:
    """What `diagnose --endpoint` needs besides the config: the server, how to read it, and the usual diagnose
    settings (prompts, group, out, weights, budget, progress; sensitivity / recipes do not apply)."""

    url: str
    served_model: str | None = None  # the request's `model`; None: the first GET /v1/models lists
    logprobs_mode: str = "raw"
    top_logprobs: int = 5  # top log-probs asked per position (the OpenAI API allows 5; vLLM --max-logprobs, 20)
    timeout_s: float = 120.0  # per request
    concurrency: int = 4
    api_key: str | None = None
    diagnose: DiagnoseSettings = field(default_factory=DiagnoseSettings)


@dataclass(frozen=True)
class _Named:
    """The name and weights text measure.summarise reads from a candidate."""

    name: str
    weights: str

    def weights_description(self) -> str:
        return self.weights


def check_endpoint_settings(settings: EndpointSettings) -> None:
    """Every bad setting fails here, before the server is called or a model loaded. Raises ValueError."""
    d = settings.diagnose
    if settings.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"--logprobs-mode must be one of {LOGPROBS_MODES}, got {settings.logprobs_mode!r}")
    if not 0 <= settings.top_logprobs <= 20:
        raise ValueError(f"--top-logprobs must be in [0, 20], got {settings.top_logprobs}")
    if not settings.timeout_s > 0 or settings.concurrency < 1:
        raise ValueError(f"--timeout must be > 0 and --concurrency >= 1, got {settings.timeout_s}, "
                         f"{settings.concurrency}")
    if d.prompts < 1 or d.group_size < 1:
        raise ValueError(f"--prompts and --group must be >= 1, got {d.prompts}, {d.group_size}")
    if d.budget_floor_multiple is not None:
        raise ValueError("--budget-floor-multiple needs a noise floor, which an endpoint diagnosis does not measure; "
                         "use --budget-k3 or the default sequence-ESS budget")
    EndpointClient(settings.url)  # the URL's form


def run_endpoint_diagnosis(cfg, settings: EndpointSettings, log=print) -> tuple[dict, int]:
    """Sample from the server, score the same ids with the reference, check the sampler and decide. Returns (the JSON
    report, exit code 0 when admitted, 1 when rejected). Raises ValueError for a bad setting (before anything is
    called or loaded) and EndpointError when the server cannot be measured (unreachable, timeout, no log-probs, a
    different tokenizer, a truncated or malformed answer): then no verdict exists."""
    from nearpolicy.diagnosis.run import _context

    check_endpoint_settings(settings)
    client = EndpointClient(settings.url, settings.timeout_s, settings.api_key)
    served = _served_model(client, settings.served_model)  # an unreachable server fails before the model loads
    log(f"endpoint {client.v1}: model {served!r}")
    ctx = _context(cfg, settings.diagnose, log)
    try:
        return _diagnose(ctx, client, served, settings, str(cfg.model.path))
    finally:
        shutil.rmtree(ctx.workdir, ignore_errors=True)


def _served_model(client: EndpointClient, wanted: str | None) -> str:
    names = client.models()
    if wanted is None:
        if not names:
            raise EndpointError("model", f"GET {client.v1}/models lists no model; name one with --served-model")
        return names[0]
    if wanted not in names:
        raise EndpointError("model", f"--served-model {wanted!r} is not among the models the server lists: {names}")
    return wanted


def _diagnose(ctx: DiagnoseContext, client: EndpointClient, served: str, settings: EndpointSettings, reference: str):
    stop_ids = stop_token_ids(ctx.model, ctx.tokenizer, ctx.template_gguf, ctx.workdir)
    requests = sample_requests(ctx, stop_ids, settings.top_logprobs)
    bar = tqdm(total=len(requests), desc="diagnose endpoint", disable=not settings.diagnose.progress,
               dynamic_ncols=True, unit="sample")
    t0 = time.perf_counter()
    samples = client.sample_all(served, requests, settings.concurrency, lambda: bar.update(1))
    seconds = time.perf_counter() - t0
    bar.close()
    resolved, identity = resolve(samples, ctx.tokenizer, stop_ids)
    prompts = _engine_prompts(client, ctx, resolved, identity)
    measured = [(r, prompts[r.sample.request.prompt_index]) for r in resolved if r.completion_ids is not None]
    if len(measured) < MIN_COVERAGE * len(resolved):
        raise EndpointError("tokenizer", f"only {len(measured)} of {len(resolved)} completions map to token ids "
                                         f"(the server returned token strings the reference vocabulary does not "
                                         f"hold); a verdict needs {MIN_COVERAGE:.0%}")
    check_logprob_coverage([r for r, _ in measured])
    batch, top_ids, top_lp = _collate(ctx, measured, settings.top_logprobs)
    scored = score(ctx, batch, top_ids, top_lp, settings.logprobs_mode, settings.top_logprobs)
    defined = batch.mask & batch.has_rollout
    name = _Named(f"endpoint: {served}", f"served by {client.v1}")
    result = summarise(name, scored["logprobs"], batch.rollout_logprobs, defined, ctx.position_bucket, seconds)
    identity.details["stop_token_returned"] = sum(r.completion_ids[-1] in stop_ids for r, _ in measured
                                                  if r.completion_ids)
    drift = retokenization_row(identity, _retokenization_delta(ctx, measured, stop_ids))
    found = checks(scored, ctx.sampling, settings.diagnose, ctx.sampling.max_new_tokens, settings.top_logprobs)
    report = endpoint_report(ctx, settings, served, client.v1, reference, result, found, drift)
    return report, 0 if report["admitted"] else 1


def check_logprob_coverage(measured: list[ResolvedSample]) -> None:
    """Raises EndpointError("no_logprobs") unless at least MIN_COVERAGE of the measured completions' tokens carry a
    finite log-prob from the server. A sampled token's None, -inf or <= ENGINE_ZERO (probability 0, impossible for a
    token the server drew) is missing; the few tokens missing under the floor are left out of k3 (_collate)."""
    total = sum(len(r.sample.logprobs) for r in measured)
    finite = sum(lp is not None and math.isfinite(lp) for r in measured for lp in r.sample.logprobs)
    if total == 0 or finite < MIN_COVERAGE * total:
        raise EndpointError("no_logprobs", f"only {finite} of {total} sampled tokens carry a finite log-prob from "
                                           f"the server (the others: none, -inf or <= {ENGINE_ZERO:g}, i.e. "
                                           f"probability 0 for a token it drew); a verdict needs {MIN_COVERAGE:.0%}")


def sample_requests(ctx: DiagnoseContext, stop_ids: set[int], top_logprobs: int) -> list[SampleRequest]:
    """group_size requests per prompt (n = 1 each), seeded by (run seed, prompt, sample) with 31-bit seeds (every
    server takes them), prompt text = the reference tokenizer's decoding of the templated ids."""
    s = ctx.sampling
    out = []
    for i, prompt in enumerate(ctx.prompts):
        text = ctx.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for k in range(ctx.group_size):
            seed = int(np.random.SeedSequence([ctx.seed, i, k]).generate_state(1)[0] >> 1)
            out.append(SampleRequest(i, k, tuple(prompt), text, s.max_new_tokens, s.temperature, s.top_p, s.top_k,
                                     seed, top_logprobs, tuple(sorted(stop_ids))))
    return out


def _engine_prompts(client: EndpointClient, ctx: DiagnoseContext, resolved: list[ResolvedSample],
                    identity: TokenIdentity) -> list[list[int]]:
    """The prompt ids the server ran, per prompt: the ids sent (a server that echoes others is an error); for a
    text prompt, the server's own tokenization where it offers one, else the reference's ids (marked unknown)."""
    out, drifted, source = [], 0, "sent as ids"
    for i, prompt in enumerate(ctx.prompts):
        mine = [r.sample for r in resolved if r.sample.request.prompt_index == i]
        echo = next((s.prompt_echo for s in mine if s.prompt_echo is not None), None)
        if identity.prompt_sent_as == "ids":
            if echo is not None and echo != list(prompt):
                raise EndpointError("prompt", f"prompt {i}: the server ran ids other than those sent (first "
                                              f"difference at {_first_difference(echo, prompt)}): it rewrites prompts")
            out.append(list(prompt))
            continue
        ran = echo or (client.server_tokenize(mine[0].request.prompt_text) if mine else None)
        if ran is not None:
            source = "server tokenization"
        else:
            source = "unknown (the server's prompt-token count only)"
            counted = next((s.usage.get("prompt_tokens") for s in mine if s.usage.get("prompt_tokens")), None)
            ran = list(prompt) if counted in (None, len(prompt)) else None
        drifted += ran != list(prompt)
        out.append(list(ran) if ran is not None else list(prompt))
    identity.details |= {"prompts": len(ctx.prompts), "prompts_drifted": drifted, "prompt_ids_from": source}
    return out


def _first_difference(a: list[int], b) -> int:
    return next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _collate(ctx: DiagnoseContext, measured: list[tuple[ResolvedSample, list[int]]], k: int):
    """(TokenBatch of the measured completions, engine top ids [B, T, K] int64 (-1 absent), their log-probs
    [B, T, K] float64 (-inf absent)) with K = the most entries listed at one position (at least 1)."""
    rollouts = []
    for r, prompt in measured:
        s = r.sample
        ids = r.completion_ids
        lps = [lp if lp is not None and math.isfinite(lp) else None for lp in s.logprobs]
        rollouts.append(Rollout(s.request.prompt_index, s.request.sample_index, prompt, ids, lps, [0] * len(ids),
                                s.finish_reason if s.finish_reason in ("stop", "length") else "length"))
    vocab = ctx.model.get_output_embeddings().weight.shape[0]
    batch = collate(rollouts, pad_token_id(ctx.tokenizer), vocab)
    B, T = batch.completion_ids.shape
    K = max([1] + [len(row) for r, _ in measured for row in r.top_ids])
    top_ids = torch.full((B, T, K), -1, dtype=torch.long)
    top_lp = torch.full((B, T, K), -math.inf, dtype=torch.float64)
    for b, (r, _) in enumerate(measured):
        for t, row in enumerate(r.top_ids):
            for j, (i, lp) in enumerate(row.items()):
                top_ids[b, t, j], top_lp[b, t, j] = i, -math.inf if lp is None else lp
    return batch, top_ids, top_lp


@torch.no_grad()
def score(ctx: DiagnoseContext, batch, top_ids: torch.Tensor, top_lp: torch.Tensor, mode: str, k: int) -> dict:
    """The reference on the batch's ids, micro-batch by micro-batch: its log-probs [B, T] (float32, nats; 0 at
    padding; the transformer body under algorithm.trainer_precision, as the run's trainer would score them) under the
    mode's transform; and, from the fp32 model (a second forward when the trainer runs bf16), per valid position
    (flattened, [n]) the top-k bounds and the support replay of the claimed sampler, plus the temperature fit's summed
    statistics [G, 3] (ops/distribution_checks)."""
    claimed = ctx.sampling
    transform = claimed if mode == "processed" else SamplingParams(1.0, 1.0, 0, claimed.max_new_tokens)
    logprobs = torch.zeros(batch.completion_ids.shape)
    defined = batch.mask & batch.has_rollout
    fit = torch.zeros(len(TEMPERATURE_GRID), 3, dtype=torch.float64)
    bounds, support = [], []
    for start in range(0, len(batch), ctx.micro_batch_size):
        rows = slice(start, start + ctx.micro_batch_size)
        sub = batch.select(rows)
        with trainer_compute(ctx.trainer_precision):  # the mismatch: the reference as the run's trainer computes it
            logits, valid = completion_logits(ctx.model, sub)
        ids = sub.completion_ids[valid]
        picked, _ = token_logprobs_and_entropy(logits, ids, transform.temperature, transform.top_k, transform.top_p)
        logprobs[rows] = torch.zeros(valid.shape).masked_scatter(valid, picked.float())
        if ctx.trainer_precision != "fp32":  # the sampler checks judge the server against the exact (fp32) model
            logits = completion_logits(ctx.model, sub)[0]
        ref = transformed_log_softmax(logits, transform.temperature, transform.top_k, transform.top_p, always_keep=ids)
        bounds.append(topk_bounds(ref, top_ids[rows][valid], top_lp[rows][valid], k)
                      | {"defined": defined[rows][valid]})
        support.append(support_replay(logits, ids, claimed.temperature, claimed.top_k, claimed.top_p))
        fit += temperature_fit_stats(logits, ids, claimed.temperature, claimed.top_k, claimed.top_p)
    cat = lambda parts: {key: torch.cat([p[key] for p in parts]) for key in parts[0]}  # noqa: E731
    return {"logprobs": logprobs, "bounds": cat(bounds), "support": cat(support), "fit": fit}


def _retokenization_delta(ctx: DiagnoseContext, measured, stop_ids: set[int]) -> dict:
    """For the completions whose text re-encodes to other ids: how many, the tokens they differ in length by, and
    the reference's sequence log-prob of the re-encoded ids minus that of the sampled ones (nats, raw log softmax:
    what a decode-and-re-encode client would feed the trainer)."""
    changed = retokenize(ctx.tokenizer, [r for r, _ in measured], stop_ids)
    out = {"completions_checked": len(measured), "completions_changed": len(changed)}
    if not changed:
        return out
    raw = SamplingParams(1.0, 1.0, 0, ctx.sampling.max_new_tokens)
    rows = []
    for n, body, again in changed:
        r, prompt = measured[n]
        for g, ids in enumerate((body, again)):
            rows.append(Rollout(2 * n + g, 0, prompt, ids or [pad_token_id(ctx.tokenizer)], [None] * max(1, len(ids)),
                                [0] * max(1, len(ids)), "length"))
    batch = collate(rows, pad_token_id(ctx.tokenizer), ctx.model.get_output_embeddings().weight.shape[0])
    seq = torch.where(batch.mask, recompute_logprobs(ctx.model, batch, raw, ctx.micro_batch_size)[0], 0.0).sum(-1)
    delta = (seq[1::2] - seq[0::2]).double()
    lengths = [abs(len(again) - len(body)) for _, body, again in changed]
    return out | {"mean_abs_length_change": float(np.mean(lengths)), "seq_logprob_delta_mean_abs":
                  float(delta.abs().mean()), "seq_logprob_delta_max_abs": float(delta.abs().max())}


def api_key_from_env(name: str | None) -> str | None:
    """The API key in environment variable `name` (None when no name is given). Raises ValueError when it is unset."""
    if name is None:
        return None
    if not os.environ.get(name):
        raise ValueError(f"--api-key-env {name}: the environment variable is not set")
    return os.environ[name]
