"""nearpolicy: RL post-training where the training-inference mismatch is measured and corrected.

Log-prob names used everywhere (see docs/math.md):
    logprobs          log pi_theta(y_t | .)   current trainer policy, carries grad
    old_logprobs      log pi_old(y_t | .)     trainer at the sampling weights (proximal), detached
    rollout_logprobs  log mu(y_t | .)         what the rollout engine reported when it sampled y_t
Ratios: PPO ratio r = exp(logprobs - old_logprobs); mismatch weight rho = exp(old_logprobs - rollout_logprobs).
"""

__version__ = "0.1.0"
