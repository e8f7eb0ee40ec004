"""Named mismatch corrections: each preset expands to one composable CorrectionSpec (ops/corrections.py).

CORRECTIONS.get(name)() -> CorrectionSpec; `correction_spec(name, **overrides)` replaces fields (e.g. the cap).
Thresholds are the defaults of the cited source. Presets marked "use loss=reinforce" are verl's bypass
policy-gradient presets, meant for POLICY_LOSSES["reinforce"]; bypass presets with the PPO loss carry no IS
weight (the PPO ratio against the engine's log-probs already contains it) and only reject.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nearpolicy.ops.corrections import CorrectionSpec, RejectionRule
from nearpolicy.registry import Registry

CorrectionPreset = Callable[[], CorrectionSpec]
CORRECTIONS: Registry[CorrectionPreset] = Registry("correction")

GEO_RS = RejectionRule.ratio("seq_mean", 0.999, 1.001)  # verl "0.999_1.001" on the geometric-mean ratio
K3_RS = RejectionRule("k3", "seq_mean", upper=0.01)  # verl seq_mean_k3 threshold 0.01
VERL = "verl rollout_corr_helper.py / RolloutCorrectionConfig presets (commit b178a3cd)"


def _preset(name: str, spec: CorrectionSpec, summary: str, source: str) -> None:
    CORRECTIONS.register(name, summary=summary, source=source)(lambda: spec)


_preset("off", CorrectionSpec(), "no correction (w = 1)", "-")
_preset("token_is", CorrectionSpec("token", "none"), "plain token IS w = rho_t = pi_old / mu (AReaL decoupled PPO)",
        "AReaL arXiv:2505.24298 (decoupled PPO objective); Hilton et al. arXiv:2110.00641")
_preset("areal_cap", CorrectionSpec("token", "mask", 0.0, 5.0), "token IS, tokens with rho_t > 5 masked",
        "AReaL behav_imp_weight_cap (2025 form), example cap 5.0")
_preset("tis", CorrectionSpec("token", "truncate", 0.0, 2.0), "truncated token IS w = min(rho_t, 2)",
        "Yao et al. 2025 'Your Efficient RL Framework Secretly Brings You Off-Policy RL Training'; verl PR #2953")
_preset("token_mis", CorrectionSpec("token", "mask", 0.5, 2.0), "token masked IS: drop tokens with rho_t outside [0.5, 2]",
        "Liu, Li et al. 2025 'When Speed Kills Stability'; bounds of slime mis.yaml")
_preset("icepop", CorrectionSpec("token", "mask", 0.5, 5.0), "IcePop: w = rho_t inside [0.5, 5], token dropped outside",
        "Ring-1T arXiv:2510.18855; NeMo-RL icepop defaults")
_preset("seq_tis", CorrectionSpec("sequence", "truncate", 0.0, 2.0), "sequence IS w = min(prod_t rho_t, 2)",
        VERL + " (decoupled_seq_is)")
_preset("seq_mis", CorrectionSpec("sequence", "mask", 0.0, 2.0), "sequence masked IS: drop sequences with prod rho > 2",
        "Liu, Li et al. 2025 'When Speed Kills Stability' (seq-MIS)")
SEQ_RS = RejectionRule.ratio("seq_sum", 0.5, 2.0)  # verl seq_sum_k1 "0.5_2.0", as bounds on prod rho
_preset("seq_tis_rs", CorrectionSpec("sequence", "truncate", 0.0, 2.0, rejections=(SEQ_RS,)),
        "sequence TIS (cap 2) + reject sequences with prod rho outside [0.5, 2]", VERL + " (decoupled_seq_is_rs)")
_preset("geo_tis", CorrectionSpec("geometric", "truncate", 0.0, 2.0), "geometric-mean sequence IS, capped at 2",
        "slime/Miles tis_level=geometric; length-invariant form of seq_tis")
_preset("geo_mis", CorrectionSpec("geometric", "mask", 0.9999, 1.0001),
        "drop sequences with geometric-mean rho outside +-0.01%",
        "slime/Miles mis.yaml geometric bounds 0.9999 / 1.0001")
_preset("geo_rs", CorrectionSpec(rejections=(GEO_RS,)),
        "no IS; reject sequences with geometric-mean rho outside [0.999, 1.001]",
        VERL + " (decoupled_geo_rs)")
_preset("geo_rs_token_tis", CorrectionSpec("token", "truncate", 0.0, 2.0, rejections=(GEO_RS,)),
        "geo_rs + token TIS (cap 2)",
        VERL + " (decoupled_geo_rs_token_tis)")
_preset("seq_mask_tis", CorrectionSpec("token", "none", rejections=(RejectionRule.ratio("seq_mean", 0.999, 1.002),)),
        "keep sequences with geometric-mean rho in [0.999, 1.002], weight kept ones by raw token rho_t",
        "NeMo-RL ProRL v2.1 seq-mask-tis")
_preset("k3_rs", CorrectionSpec(rejections=(K3_RS,)), "reject sequences whose mean k3 KL(mu || pi_old) > 0.01",
        VERL + " (decoupled_k3_rs)")
_preset("k3_rs_token_tis", CorrectionSpec("token", "truncate", 0.0, 2.0, rejections=(K3_RS,)), "k3_rs + token TIS (cap 2)",
        VERL + " (decoupled_k3_rs_token_tis)")
_preset("token_tis_veto", CorrectionSpec("token", "truncate", 0.5, 2.0, veto=1e-4),
        "token TIS clamped to [0.5, 2]; veto whole sequence if any rho_t < 1e-4",
        "slime/Miles mis.yaml (rs_veto_threshold 1e-4); verl rollout_token_veto_threshold (418f964ab)")
_preset("tis_snis", CorrectionSpec("token", "truncate", 0.5, 2.0, self_normalize="token"),
        "token TIS clamped to [0.5, 2], self-normalised: w / mean over the batch's tokens",
        "slime/Miles mis.yaml (tis_batch_normalize: true); verl rollout_is_batch_normalize")
_preset("seq_tis_snis", CorrectionSpec("sequence", "truncate", 0.0, 2.0, self_normalize="sequence"),
        "sequence TIS (cap 2), self-normalised: w / mean over the batch's sequences",
        VERL + " (decoupled_seq_is with rollout_is_batch_normalize=True)")
_preset("bypass_ppo_clip", CorrectionSpec(mode="bypass"), "PPO ratio taken against the engine's log-probs, no IS weight",
        VERL + " (bypass_ppo_clip)")
_preset("bypass_ppo_clip_geo_rs", CorrectionSpec(mode="bypass", rejections=(GEO_RS,)),
        "bypass_ppo_clip + geo_rs on pi_theta / mu",
        VERL + " (bypass_ppo_clip_geo_rs)")
_preset("bypass_ppo_clip_k3_rs", CorrectionSpec(mode="bypass", rejections=(K3_RS,)),
        "bypass_ppo_clip + k3_rs on pi_theta / mu",
        VERL + " (bypass_ppo_clip_k3_rs)")
_preset("bypass_pg_is", CorrectionSpec("sequence", "truncate", 0.0, 2.0, mode="bypass"),
        "sequence IS min(prod pi_theta / mu, 2); use loss=reinforce", VERL + " (bypass_pg_is)")
_preset("bypass_pg_geo_rs", CorrectionSpec(mode="bypass", rejections=(GEO_RS,)),
        "geo_rs on pi_theta / mu; use loss=reinforce",
        VERL + " (bypass_pg_geo_rs)")
_preset("bypass_pg_geo_rs_token_tis", CorrectionSpec("token", "truncate", 0.0, 2.0, mode="bypass", rejections=(GEO_RS,)),
        "geo_rs + token TIS on pi_theta / mu; use loss=reinforce", VERL + " (bypass_pg_geo_rs_token_tis)")
_preset("minpro", CorrectionSpec("prefix_min", "none", mode="bypass"),
        "w_t = sg(min_{i<t} pi_theta / mu) times the loss (reconstruction)",
        "MinPRO, reconstructed from the abstract of arXiv:2601.22718 (docs/math.md sec. 10)")
_preset("minpro_inclusive", CorrectionSpec("prefix_min", "none", mode="bypass", prefix_inclusive=True),
        "minpro with the current token in the min (i <= t) (reconstruction variant)",
        "MinPRO variant, reconstructed from the abstract of arXiv:2601.22718")
_preset("minpro_cap1", CorrectionSpec("prefix_min", "truncate", 0.0, 1.0, mode="bypass"),
        "minpro with w_t <= 1: only down-weights (reconstruction variant)",
        "MinPRO variant, reconstructed from the abstract of arXiv:2601.22718")
_preset("pnpo_weight", CorrectionSpec("prefix_geometric", "none", mode="bypass"),
        "detached prefix geometric-mean ratio as a weight; the clipped form is POLICY_LOSSES['pnpo']",
        "PNPO variant, reconstructed from the abstract of arXiv:2608.01418 (docs/math.md sec. 11)")


PRESET_FIELDS = ("level", "action", "lower", "upper", "mode", "veto", "mix", "self_normalize")
"""The CorrectionSpec fields a named preset sets and a config may replace (config.CorrectionConfig)."""


def drop_replaced_preset_fields(section: dict | None, default_preset: str,
                                overrides: dict[tuple[str, ...], object]) -> None:
    """Config layering (config.load_config): when the upper layer's `overrides` ((key,) -> value within
    [correction]) change the preset, drop from the lower layer's raw [correction] `section` (in place) the preset
    fields the upper layer does not set itself: they belong to the old preset (--set correction.preset=icepop over
    a file with upper = 2.0 then runs IcePop on its own [0.5, 5], not on [0.5, 2])."""
    new = overrides.get(("preset",))
    if new is None or not isinstance(section, dict):
        return
    canonical = lambda name: "off" if name == "none" else name  # noqa: E731
    if canonical(new) == canonical(section.get("preset", default_preset)):
        return
    for name in PRESET_FIELDS:
        if (name,) not in overrides:
            section.pop(name, None)


def correction_spec(name: str, **overrides: object) -> CorrectionSpec:
    """The preset `name` with fields replaced, e.g. correction_spec("tis", upper=8.0). Raises KeyError for an
    unknown name (listing the valid ones) and ValueError for invalid field values."""
    return replace(CORRECTIONS.get(name)(), **overrides)



def describe_correction(preset: str, spec: CorrectionSpec) -> str:
    """One line naming the preset and what it computes, e.g. "icepop: token mask [0.5, 5], decoupled"; the
    effective correction a run uses after its config layers are merged (printed at start, shown by summary,
    report and compare)."""
    if spec.action == "off":
        core = "no IS weight"
    else:
        core = f"{spec.level} {spec.action}"
        if spec.action in ("truncate", "mask"):
            core += f" [{spec.lower:g}, {spec.upper:g}]"
    parts = [core, spec.mode]
    parts += [f"reject {r.statistic} at {r.level} in [{r.lower:.4g}, {r.upper:.4g}]" for r in spec.rejections]
    if spec.veto is not None:
        parts.append(f"veto {spec.veto:g}")
    if spec.mix != 1.0:
        parts.append(f"mix {spec.mix:g}")
    if spec.self_normalize != "off":
        parts.append(f"self-normalised per {spec.self_normalize}")
    if spec.prefix_inclusive:
        parts.append("prefix inclusive")
    return f"{preset}: {', '.join(parts)}"
