"""Rollout engines behind one protocol (`engines.base.RolloutEngine`); adapters import their backends lazily."""
