"""nearpolicy: RL post-training where the training-inference mismatch is measured and corrected.

Log-prob names used everywhere (see docs/math.md):
    logprobs          log pi_theta(y_t | .)   current trainer policy, carries grad
    old_logprobs      log pi_old(y_t | .)     trainer at the sampling weights (proximal), detached
    rollout_logprobs  log mu(y_t | .)         what the rollout engine reported when it sampled y_t
Ratios: PPO ratio r = exp(logprobs - old_logprobs); mismatch weight rho = exp(old_logprobs - rollout_logprobs).

Python API (api.py): `nearpolicy.load_config`, `nearpolicy.Config`, `nearpolicy.train`, `nearpolicy.read_metrics`,
`nearpolicy.read_samples`; a script calling `train` needs an `if __name__ == "__main__":` guard.
"""

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "TrainResult", "TrainingError", "load_config", "read_metrics", "read_samples",
           "train"]


def __getattr__(name: str):
    """The Python API (api.py), imported on first use so that `import nearpolicy` stays light."""
    if name in __all__:
        from nearpolicy import api

        return getattr(api, name)
    raise AttributeError(f"module 'nearpolicy' has no attribute {name!r}")
