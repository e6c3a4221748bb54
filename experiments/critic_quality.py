"""Learned critic against prefix-tree values on exact ground truth (issue 24, item 5).

    python -m experiments.critic_quality [--budgets 512,2048,8192,32768] [--group_size 8]
        [--eval_prompts 512] [--seeds 2] [--targets returns,tree]
        [--workdir /tmp/treecredit/critic_quality]

On `token_tree` (as `experiments/credit_quality.py`: 4 symbols, depth 6, 3 decisive
positions, A*_t = V(s_{t+1}) − V(s_t) exact under the reference policy) a critic, the
project's decoder with a value head (`experiments/training/critic.py`, d 64, 2 layers, fresh
weights), regresses Monte Carlo returns of reference-policy rollouts it sees in batches of
64 prompts x G; after each budget of rollouts seen, its TD advantages
A_t = V̂(s_{t+1}) − V̂(s_t) (V̂ after the last token := the reward) on a fixed evaluation batch
are scored against A* (Pearson correlation; sign agreement on decisive tokens;
`credit_quality.credit_metrics`). The nonparametric estimators (`tempo`, `treerl`,
`mc_values`, `grpo`) are scored on the same evaluation batch, from its own G responses per
prompt only. The question: after how many rollouts, if ever, does the learned critic beat
the prefix-tree values? `--targets` picks what the critic regresses: 'returns' (each token's
Monte Carlo return, the response's reward) and/or 'tree' (a process value model trained on
TEMPO's prefix-tree values of its training groups, V̂(s_t) = the mean reward of the group's
responses sharing the first t tokens, `trees.prefix_values`: lower-variance labels from the
same rollouts). Writes critic_quality.json and critic_quality.png.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import credit
import envs
from experiments import credit_quality as cq
from experiments.models import decoder
from experiments.training import critic as critic_lib
from experiments.training import train_step as ts

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NONPARAMETRIC = ("tempo", "treerl", "mc_values", "grpo")
TRAIN_PROMPTS = 64


def critic_advantages(params, cfg, prompts, tokens, rewards):
  """float32 [B, G, L]: V̂(s_{t+1}) − V̂(s_t) from the critic, V̂ after the last token = R."""
  v = critic_lib.group_values(params, prompts, tokens, cfg=cfg)  # [B, G, L]
  nxt = jnp.concatenate([v[..., 1:], rewards[..., None]], -1)
  return nxt - v


def run_seed(task, seed: int, budgets, group_size: int, eval_prompts: int, lr: float,
             targets=("returns",)):
  key = jax.random.key(seed)
  prompts, info = task.sample(jax.random.fold_in(key, 0), eval_prompts)
  tokens, mask, rewards, logp, true_adv, _ = cq._rollouts(task, jax.random.fold_in(key, 1),
                                                          info, group_size)
  decisive = np.asarray(info["decisive"])[:, None, :]
  decisive = np.concatenate([decisive, np.zeros(decisive.shape[:-1] + (1,), bool)], -1)
  score = lambda adv: cq.credit_metrics(adv, true_adv, mask, decisive)
  rollouts = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, logprobs=logp)
  out = {"nonparametric": {n: score(cq._jitted(n)(rollouts)) for n in NONPARAMETRIC}}
  for target in targets:
    out["critic" if target == "returns" else f"critic_{target}"] = _train_and_score(
        task, key, seed, budgets, group_size, lr, target, score, prompts, tokens, rewards)
  return out


def _train_and_score(task, key, seed, budgets, group_size, lr, target, score, prompts, tokens,
                     rewards):
  """{rollouts seen: metrics} of a fresh critic regressing `target` labels."""
  if target not in ("returns", "tree"):
    raise ValueError(f"unknown critic target {target!r}; choose 'returns' or 'tree'.")
  out = {}
  cfg = decoder.PolicyConfig(vocab_size=task.vocab_size, d_model=64, num_layers=2,
                             num_heads=4, d_ff=128, max_len=task.prompt_len + task.response_len)
  init = decoder.init_params(jax.random.PRNGKey(seed), cfg)
  state = critic_lib.init_state(init, cfg, ts.make_optimizer(lr), seed=seed)
  ccfg = critic_lib.CriticConfig(cliprange_value=0.0, num_minibatches=4)
  step = jax.jit(lambda s, b: critic_lib.critic_step(s, b, cfg=cfg, ccfg=ccfg))
  per_batch = TRAIN_PROMPTS * group_size
  seen, i = 0, 0
  for budget in sorted(budgets):
    while seen < budget:
      p, inf = task.sample(jax.random.fold_in(key, 1000 + 2 * i), TRAIN_PROMPTS)
      tk, mk, rw, _, _, _ = cq._rollouts(task, jax.random.fold_in(key, 1001 + 2 * i), inf,
                                        group_size)
      n = TRAIN_PROMPTS * group_size
      labels = (jnp.where(mk, rw[..., None], 0.0) if target == "returns"
                else critic_lib.tree_targets(tk, mk, rw))
      batch = critic_lib.CriticBatch(
          prompts=jnp.repeat(p, group_size, 0), tokens=tk.reshape(n, -1), mask=mk.reshape(n, -1),
          old_values=jnp.zeros(mk.reshape(n, -1).shape, jnp.float32),
          returns=labels.reshape(n, -1))
      state, m = step(state, batch)
      seen, i = seen + per_batch, i + 1
    adv = critic_advantages(state.params, cfg, prompts, tokens, rewards)
    out[int(seen)] = {**score(adv), "vf_loss": float(m["vf_loss"])}
  return out


def summarize(runs):
  mean_std = lambda xs: (float(np.mean(xs)), float(np.std(xs)))
  out = {"nonparametric": {}}
  for n in runs[0]["nonparametric"]:
    out["nonparametric"][n] = {k: mean_std([r["nonparametric"][n][k] for r in runs])
                               for k in ("corr", "sign")}
  for c in [c for c in runs[0] if c.startswith("critic")]:
    out[c] = {b: {k: mean_std([r[c][b][k] for r in runs]) for k in ("corr", "sign", "vf_loss")}
              for b in runs[0][c]}
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--budgets", default="512,2048,8192,32768")
  ap.add_argument("--group_size", type=int, default=8)
  ap.add_argument("--eval_prompts", type=int, default=512)
  ap.add_argument("--seeds", type=int, default=2)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--targets", default="returns", help="comma list of 'returns', 'tree'.")
  ap.add_argument("--workdir", default="/tmp/treecredit/critic_quality")
  a = ap.parse_args(argv)
  budgets = [int(x) for x in a.budgets.split(",") if x]
  task = envs.get("token_tree")
  t0 = time.time()
  targets = tuple(t for t in a.targets.split(",") if t)
  runs = [run_seed(task, s, budgets, a.group_size, a.eval_prompts, a.lr, targets)
          for s in range(a.seeds)]
  s = summarize(runs)
  print(f"token_tree, G = {a.group_size}, {a.eval_prompts} evaluation prompts, {a.seeds} seeds "
        f"(mean ± std); critic: d 64, 2 layers, regressing {'/'.join(targets)} labels "
        f"(critic_tree: TEMPO's prefix values), batches of {TRAIN_PROMPTS} x G")
  print(f"{'estimator':>28} {'corr':>14} {'sign':>14}")
  for n, m in s["nonparametric"].items():
    print(f"{n + ' (this batch)':>28} {m['corr'][0]:8.3f}±{m['corr'][1]:.3f} "
          f"{m['sign'][0]:8.3f}±{m['sign'][1]:.3f}")
  critics = [c for c in s if c.startswith("critic")]
  for c in critics:
    for b, m in s[c].items():
      print(f"{f'{c} after {b} rollouts':>34} {m['corr'][0]:8.3f}±{m['corr'][1]:.3f} "
            f"{m['sign'][0]:8.3f}±{m['sign'][1]:.3f}")
  print(f"measured in {time.time() - t0:.1f} s")
  os.makedirs(a.workdir, exist_ok=True)
  with open(os.path.join(a.workdir, "critic_quality.json"), "w") as f:
    json.dump(dict(args=vars(a), summary=s, runs=runs), f, indent=1)
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for c in critics:
    xs = list(s[c])
    ax.errorbar(xs, [s[c][b]["corr"][0] for b in xs], yerr=[s[c][b]["corr"][1] for b in xs],
                marker="o", label={"critic": "learned critic (MC returns)",
                                   "critic_tree": "learned critic (tree values)"}.get(c, c))
  for n, m in s["nonparametric"].items():
    ax.axhline(m["corr"][0], ls="--", lw=1, label=f"{n} (G = {a.group_size} per prompt)",
               color=f"C{1 + list(s['nonparametric']).index(n)}")
  ax.set_xscale("log")
  ax.set_xlabel("rollouts the critic has seen")
  ax.set_ylabel("corr with A*")
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(a.workdir, "critic_quality.png")
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")
  return s


if __name__ == "__main__":
  main()
