"""The config rules of task.mixture (ops/mixture.py; docs/math.md sec. 27), called by config/schema.py's Config."""

from __future__ import annotations

from nearpolicy.config.checks import refuse_unused


def check_mixture(cfg) -> None:
    """task.mixture = "adaptive" needs a mixture (task.kind reasoning_gym, task.name composite) and the synchronous
    single-turn rollouts it draws for (no replicas, episodes, POPO replay or R-OPD switch: they pick their problems
    elsewhere, replicas ahead of the feedback). Raises ValueError naming the keys."""
    t = cfg.task
    adaptive = t.mixture == "adaptive"
    refuse_unused(t, "task", ["mixture_decay", "mixture_floor"], f"task.mixture = {t.mixture!r}", adaptive)
    if not adaptive:
        return
    if t.kind != "reasoning_gym" or t.name != "composite":
        raise ValueError(f"task.mixture = 'adaptive' reweights the datasets of a mixture, and task.kind = {t.kind!r} / "
                         f"task.name = {t.name!r} is not one: set task.name = 'composite' with task.options.datasets, "
                         "or task.mixture = 'fixed'")
    others = {"rollout.engines >= 1": cfg.rollout.engines > 0, "episode.enabled": cfg.episode.enabled,
              "popo.enabled": cfg.popo.enabled, "distill.ropd": cfg.distill.ropd}
    if on := [name for name, set_ in others.items() if set_]:
        raise ValueError(f"task.mixture = 'adaptive' draws the prompts of synchronous single-turn rollouts only; it is "
                         f"not combined with {', '.join(on)} yet: use task.mixture = 'fixed' or remove those settings")
