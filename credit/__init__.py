"""Advantage estimators as pure functions, registered by name.

    adv = credit.get("tempo")(rollouts)   # float32 [..., G, L]
"""

# Importing the modules registers their estimators.
from credit import (agents, frpo, outcome, pure, returns, siblings, spo, tempo, tree_grpo,  # noqa: F401
                    treepo, treerl)
# The seeds' reweighting families (issue 22), one module a family.
from credit import (answer_mask, confidence, context_shift, difficulty,  # noqa: F401
                    entropy_guided, entropy_weighting, implied_values, polarity, saliency)
# Value-based credit beside tree values (issue 24); milestone and probe credit (issue 23).
from credit import (expert_traces, hindsight, milestones, probes, replay, tool_credit,  # noqa: F401
                    tree_search, turn_norm, turn_weighting, values)
from credit import catalogue  # noqa: F401  (the method catalogue; `python -m credit`)
from credit import progress_scores  # noqa: F401  (progress advantage as a scorer, #52)
from credit.vocabulary import NEEDS  # noqa: F401  (the vocabulary of `needs`)
from credit.kl import kl_k1, kl_k2, kl_k3, kl_penalty
from credit.registry import (ALIASES, canonical, check_hparams, get, hparam_names, init_state,
                             loss_mask, names, needs, per_prompt, register, row_masked, stateful,
                             update_state)
from credit.returns import (discounted_returns, gae_advantages, outcome_token_rewards,
                            reverse_linear_scan, td_lambda_returns)
from credit.rollouts import Rollouts, StepProbes, tree_of
from credit.turns import Turns, turn_to_tokens, validate_turns
from credit.validate import validate
