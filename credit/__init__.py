"""Advantage estimators as pure functions, registered by name.

    adv = credit.get("tempo")(rollouts)   # float32 [..., G, L]
"""

from credit import outcome, returns, tempo  # noqa: F401  (registers the estimators)
from credit.kl import kl_k1, kl_k2, kl_k3, kl_penalty
from credit.registry import get, names, register
from credit.returns import (discounted_returns, gae_advantages, outcome_token_rewards,
                            reverse_linear_scan, td_lambda_returns)
from credit.rollouts import Rollouts
from credit.tempo import tree_of
from credit.validate import validate
