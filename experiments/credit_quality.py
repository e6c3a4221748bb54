"""Credit accuracy of every registered estimator against the exact advantages of token_tree.

    python -m experiments.credit_quality [--group_sizes 4,8,16,64] [--num_prompts 512]
        [--max_responses 8192] [--seed 0] [--seeds 1] [--estimators "grpo,treerl[variant='code']"]
        [--num_decisive 3] [--depth 6] [--graded] [--workdir /tmp/treecredit/credit_quality]

On the token-tree task (`envs.token_tree`) the true advantage of response token t
under the sampling (reference) policy is A*_t = V(s_{t+1}) − V(s_t), known exactly
from `state_values`. For each group size G the script samples B prompts and G
i.i.d. responses per prompt from the reference policy, runs every estimator in
`credit.names()` (jitted over the whole [B, G, L] batch) and compares its
advantages with A* over all response tokens:

  corr: Pearson correlation of a and A* (0 when either is constant);
  mse:  mean (α·a − A*)² with the least-squares scale α = <a, A*>/<a, a> (α = 0 for a ≡ 0);
  sign: on decisive tokens (a decisive position with A* ≠ 0), the fraction with
        sign(a) == sign(A*); a zero advantage counts as a disagreement.

The rollouts carry logprobs = old_logprobs = ref_logprobs = log π_ref, so every KL
term is 0; values, token_rewards and tree are None (estimators use the prefix tree
of the tokens). The optional inputs of the reweighting estimators are exact:
`entropy` is the entropy of the tabular policy's next-token distribution at each
position (0 at the final EOS, which is certain); `context_logprobs` are the sampled
tokens' log-probs under the next prompt's key (the loop's default changed context: the
prompts rolled by one); `prompt_logprobs` are the prompt tokens' log-probs under the
task's own prompt distribution (uniform decisive positions and key symbols; the tabular
policy has no prompt model). Saliency is left None (a tabular policy has no input
embeddings; `grail` is skipped). A stateful estimator is scored with its initial state
(`credit.init_state`). An estimator that raises ValueError/TypeError (a missing field,
e.g. gae without critic values) is skipped. It measures; it does not tune.
Writes credit_quality.json and credit_quality.png into --workdir.
"""

import argparse
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import credit
import envs
from experiments.training import methods

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = ("corr", "mse", "sign")
ROLLOUT_NOTE = ("logprobs = old_logprobs = ref_logprobs = log π_ref (KL terms are 0); "
                "values, token_rewards, tree, saliency = None (prefix tree of the tokens); "
                "entropy, context_logprobs (next prompt's key), prompt_logprobs exact; "
                "stateful estimators at their initial state")


def credit_metrics(adv, true_adv, mask, decisive) -> dict:
  """Accuracy of advantages against the true ones, over the tokens where `mask` is True.

  adv, true_adv: float [..., L]; mask: bool [..., L]; decisive: bool broadcastable
  to [..., L], True at decisive positions. Returns {"corr", "alpha", "mse", "sign",
  "tokens", "decisive_tokens"}; all NaN if `adv` is non-finite on a valid token.
  """
  mask = np.asarray(mask, bool)
  a = np.asarray(adv, np.float64)[mask]
  t = np.asarray(true_adv, np.float64)[mask]
  on = (np.broadcast_to(np.asarray(decisive, bool), mask.shape)[mask]) & (t != 0)
  out = {"tokens": int(a.size), "decisive_tokens": int(on.sum())}
  if not np.all(np.isfinite(a)):
    return {**out, "corr": math.nan, "alpha": math.nan, "mse": math.nan, "sign": math.nan}
  ac, tc = a - a.mean(), t - t.mean()
  denom = math.sqrt(float(np.dot(ac, ac)) * float(np.dot(tc, tc)))
  corr = float(np.dot(ac, tc)) / denom if denom > 0 else 0.0
  aa = float(np.dot(a, a))
  alpha = float(np.dot(a, t)) / aa if aa > 0 else 0.0
  mse = float(np.mean((alpha * a - t) ** 2)) if a.size else math.nan
  sign = float(np.mean(np.sign(a[on]) == np.sign(t[on]))) if on.any() else math.nan
  return {**out, "corr": corr, "alpha": alpha, "mse": mse, "sign": sign}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _sample_info(task, key, n):
  """The `info` of n prompts (the prompts themselves are not needed)."""
  return task.sample(key, n)[1]


def _policy_entropy(task, info, shape):
  """float32 [B, G, L]: entropy of the tabular policy at each response position (the
  final EOS is certain: 0)."""
  logp = task.policy_logits(info)  # [B, D, K] log-probabilities
  p = jnp.exp(logp)
  ent = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # 0·log 0 = 0
  ent = jnp.concatenate([ent, jnp.zeros(ent.shape[:-1] + (1,), ent.dtype)], axis=-1)
  return jnp.broadcast_to(ent[:, None], shape).astype(jnp.float32)


def _prompt_log_probs(task, info):
  """float32 [B, P]: log-prob of each prompt token given the ones before it under the
  task's prompt distribution (m decisive positions uniformly, each showing a uniform key
  symbol, '?' elsewhere); 0 on the first token (the `Rollouts.prompt_logprobs` convention)."""
  decisive = info["decisive"]
  d, m = task.depth, task.num_decisive
  before = jnp.cumsum(decisive, axis=-1) - decisive  # decisive positions before t
  p_dec = (m - before) / (d - jnp.arange(d))
  lp = jnp.where(decisive, jnp.log(p_dec) - jnp.log(task.num_symbols), jnp.log1p(-p_dec))
  return lp.at[:, 0].set(0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _rollouts(task, key, info, group_size):
  """G reference-policy responses per prompt and their exact advantages.

  Returns tokens int32 [B, G, L], mask bool [B, G, L], rewards float32 [B, G],
  logprobs float32 [B, G, L], true advantages float32 [B, G, L] (L = R), and the
  optional inputs {entropy [B, G, L], context_logprobs [B, G, L], prompt_logprobs [B, P]}.
  """
  tokens, mask = task.sample_policy(key, info, group_size)
  group_info = jax.tree.map(lambda x: x[:, None], info)  # [B, 1, D]: broadcasts over G
  rewards = task.reward(None, tokens, mask, group_info)
  values = task.state_values(info, tokens)  # [B, G, L+1]
  true_adv = values[..., 1:] - values[..., :-1]
  next_prompt = jax.tree.map(lambda x: jnp.roll(x, -1, axis=0), info)  # the loop's default
  extra = {"entropy": _policy_entropy(task, info, tokens.shape),
           "context_logprobs": task.policy_log_probs(next_prompt, tokens),
           "prompt_logprobs": _prompt_log_probs(task, info)}
  return tokens, mask, rewards, task.policy_log_probs(info, tokens), true_adv, extra


def _split(item: str) -> tuple:
  """'treerl[variant=\'code\']' -> ('treerl', (('variant', 'code'),)); 'grpo' -> ('grpo', ())."""
  name, bracket, rest = item.partition('[')
  if bracket and not rest.endswith(']'):
    raise ValueError(f'estimator {item!r}: write name[key=value,...]')
  return name, methods._method_hparams(rest[:-1], item) if bracket else ()


@functools.cache
def _jitted(item):
  name, hp = _split(item)
  return jax.jit(functools.partial(credit.get(name), **dict(hp)))


def _initial_state(item):
  """`credit.init_state` for a registered stateful estimator, else None."""
  name, hp = _split(item)
  if name not in credit.names() or not credit.stateful(name):
    return None
  return credit.init_state(name, **dict(hp))


def prompts_for(group_size: int, num_prompts: int, max_responses: int | None) -> int:
  """B for a group size: num_prompts, capped so that B·G <= max_responses (at least 1)."""
  if max_responses is None:
    return num_prompts
  return max(1, min(num_prompts, max_responses // group_size))


def measure(task, estimators, group_sizes, num_prompts, seed, max_responses=None) -> dict:
  """Credit metrics of `estimators` for each G in `group_sizes`, one seed.

  The prompts of every G are the first B of one draw (B = `prompts_for`).
  Returns {"results": {name: {G: metrics}}, "skipped": {name: reason},
  "skipped_at": {name: {G: reason}}, "groups": {G: per-G facts}, ...}; see
  `credit_metrics` for the metrics. An estimator raising ValueError/TypeError at
  every G is skipped; at only some G, its metrics there are NaN ("skipped_at").
  """
  group_sizes = [int(g) for g in group_sizes]
  sizes = {g: prompts_for(g, num_prompts, max_responses) for g in group_sizes}
  key_prompts, key_responses = jax.random.split(jax.random.key(seed, impl="rbg"))
  info = _sample_info(task, key_prompts, max(sizes.values()))
  results = {name: {} for name in estimators}
  errors, seconds, groups = {}, {name: 0.0 for name in estimators}, {}
  for g in group_sizes:
    b = sizes[g]
    sub = jax.tree.map(lambda x: x[:b], info)
    tokens, mask, rewards, logp, true_adv, extra = _rollouts(
        task, jax.random.fold_in(key_responses, g), sub, g)
    rollouts = credit.Rollouts(tokens, mask, rewards, logprobs=logp, old_logprobs=logp,
                               ref_logprobs=logp, **extra)
    decisive = np.pad(np.asarray(sub["decisive"]), ((0, 0), (0, 1)))[:, None]  # [B, 1, L]
    r, t, m = np.asarray(rewards), np.asarray(true_adv, np.float64), np.asarray(mask)
    groups[g] = {"num_prompts": b, "tokens": int(m.sum()),
                 "reward_variance_frac": float(np.mean(r.max(-1) > r.min(-1))),
                 "success_rate": float(r.mean()),
                 "zero_mse": float(np.mean(t[m] ** 2))}  # the mse of a ≡ 0
    for name in estimators:
      start = time.perf_counter()
      try:
        adv = np.asarray(_jitted(name)(rollouts.replace(credit_state=_initial_state(name))))
      except (ValueError, TypeError) as e:
        lines = str(e).strip().splitlines() or [""]
        errors.setdefault(name, {})[g] = f"{type(e).__name__}: {lines[0]}"
        results[name][g] = credit_metrics(np.full(tokens.shape, np.nan), true_adv, mask, decisive)
        continue
      seconds[name] += time.perf_counter() - start
      if adv.shape != tokens.shape:
        raise ValueError(f"{name} returned shape {adv.shape}; expected {tokens.shape}.")
      results[name][g] = credit_metrics(adv, true_adv, mask, decisive)
  skipped = {n: next(iter(e.values())) for n, e in errors.items() if len(e) == len(group_sizes)}
  for name in skipped:
    results.pop(name)
  return {"seed": seed, "group_sizes": group_sizes, "results": results, "skipped": skipped,
          "skipped_at": {n: e for n, e in errors.items() if n not in skipped}, "groups": groups,
          "seconds": {n: s for n, s in seconds.items() if n in results}}


def summarize(runs: list[dict]) -> dict:
  """{name: {G: {metric: (mean, std)}}} over the seeds' `measure` outputs."""
  out = {}
  for name in runs[0]["results"]:
    out[name] = {}
    for g in runs[0]["group_sizes"]:
      out[name][g] = {}
      for k in METRICS + ("alpha",):
        vals = np.array([run["results"][name][g][k] for run in runs], np.float64)
        out[name][g][k] = (float(np.mean(vals)), float(np.std(vals)))
  return out


def _cell(mean_std, n_seeds, digits):
  mean, std = mean_std
  if n_seeds == 1:
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f}±{std:.{digits}f}"


def format_table(summary: dict, group_sizes, n_seeds: int) -> str:
  """Rows: estimator; per G the columns corr, rescaled mse, sign agreement."""
  w = 7 if n_seeds == 1 else 13
  name_w = max([9] + [len(n) for n in summary])
  head1 = " " * name_w + "".join(f" | {f'G={g}':^{3 * w + 2}}" for g in group_sizes)
  head2 = f"{'estimator':<{name_w}}" + "".join(
      f" | {'corr':>{w}} {'mse':>{w}} {'sign':>{w}}" for _ in group_sizes)
  lines = [head1, head2, "-" * len(head2)]
  last = lambda n: summary[n][group_sizes[-1]]["corr"][0]
  order = sorted(summary, key=lambda n: -last(n) if math.isfinite(last(n)) else math.inf)
  for name in order:
    cells = "".join(
        f" | {_cell(summary[name][g]['corr'], n_seeds, 3):>{w}}"
        f" {_cell(summary[name][g]['mse'], n_seeds, 4):>{w}}"
        f" {_cell(summary[name][g]['sign'], n_seeds, 3):>{w}}" for g in group_sizes)
    lines.append(f"{name:<{name_w}}{cells}")
  return "\n".join(lines)


def plot_metric(ax, summary: dict, group_sizes, key: str, ylabel: str, colors) -> None:
  """One panel: summary[name][G][key] = (mean, std) against G (log2 axis), one line per name."""
  for i, name in enumerate(sorted(summary)):
    mean = np.array([summary[name][g][key][0] for g in group_sizes])
    std = np.array([summary[name][g][key][1] for g in group_sizes])
    (line,) = ax.plot(group_sizes, mean, marker="os^vD"[i % 5], markersize=4, label=name,
                      color=colors[i % len(colors)], linestyle=("-", "--", ":")[i % 3])
    if np.any(std > 0):
      ax.fill_between(group_sizes, mean - std, mean + std, color=line.get_color(), alpha=0.15)
  ax.set_xscale("log", base=2)
  ax.set_xticks(group_sizes, [str(g) for g in group_sizes])
  ax.set_xlabel("group size G")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)


def save_figure(fig, path: str, title: str = "") -> str:
  """Writes fig (with an optional suptitle) to path as PNG, closes it, returns path."""
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot(summary: dict, group_sizes, path: str, title: str = "") -> str:
  """Correlation and sign agreement vs G (log2 axis), one line per estimator."""
  fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
  colors = plt.get_cmap("tab20").colors
  for ax, (k, label) in zip(axes, (("corr", "Pearson corr(a, A*)"),
                                   ("sign", "sign agreement on decisive tokens"))):
    plot_metric(ax, summary, group_sizes, k, label, colors)
  axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  return save_figure(fig, path, title)


def _jsonable(x):
  """NaN -> None, tuples -> lists, int keys -> str, recursively."""
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def _ints(text):
  return [int(x) for x in text.split(",") if x]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--group_sizes", type=_ints, default=[4, 8, 16, 64])
  parser.add_argument("--num_prompts", type=int, default=512, help="B (before the cap).")
  parser.add_argument("--max_responses", type=int, default=8192,
                      help="caps B·G (B = min(num_prompts, max_responses // G)); 0: no cap.")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--seeds", type=int, default=1, help="runs seeds seed, ..., seed+seeds-1.")
  parser.add_argument("--estimators", default="",
                      help="comma list, each name[key=value,...]; default: credit.names().")
  parser.add_argument("--workdir", default="/tmp/treecredit/credit_quality")
  for field, kind in (("num_symbols", int), ("depth", int), ("num_decisive", int),
                      ("key_prob", float), ("key_prob_spread", float)):
    parser.add_argument(f"--{field}", type=kind, default=None, help="token_tree; default: its own.")
  parser.add_argument("--graded", action=argparse.BooleanOptionalAction, default=None)
  args = parser.parse_args(argv)

  task_kwargs = {k: getattr(args, k) for k in ("num_symbols", "depth", "num_decisive", "key_prob",
                                               "key_prob_spread", "graded")
                 if getattr(args, k) is not None}
  task = envs.get("token_tree", **task_kwargs)
  estimators = methods._split_methods(args.estimators) if args.estimators else credit.names()
  for item in estimators:  # an unknown name or hyperparameter fails here, naming it
    name, hp = _split(item)
    credit.check_hparams(name, dict(hp))
  seeds = list(range(args.seed, args.seed + args.seeds))
  max_responses = args.max_responses or None

  start = time.perf_counter()
  runs = [measure(task, estimators, args.group_sizes, args.num_prompts, s, max_responses)
          for s in seeds]
  wall_s = time.perf_counter() - start
  summary = summarize(runs)
  groups = runs[0]["groups"]

  print(f"token_tree {task}; seeds {seeds}; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}")
  print(f"rollouts: {ROLLOUT_NOTE}")
  for g in args.group_sizes:
    facts = [run["groups"][g] for run in runs]
    print(f"G={g:<3} B={groups[g]['num_prompts']:<4} tokens={groups[g]['tokens']:<6} "
          f"success={np.mean([f['success_rate'] for f in facts]):.3f} "
          f"groups with reward variance={np.mean([f['reward_variance_frac'] for f in facts]):.3f} "
          f"mse of a≡0={np.mean([f['zero_mse'] for f in facts]):.4f}")
  print("corr: Pearson corr with A*; mse: mean (α·a − A*)², α least squares; "
        "sign: sign agreement on decisive tokens" + ("" if len(seeds) == 1 else
                                                    f"; mean±std over {len(seeds)} seeds"))
  print(format_table(summary, args.group_sizes, len(seeds)))
  for name, reason in runs[0]["skipped"].items():
    print(f"skipped {name}: {reason}")
  for name, at in runs[0]["skipped_at"].items():
    for g, reason in at.items():
      print(f"skipped {name} at G={g} (nan above): {reason}")
  print(f"measured in {wall_s:.1f} s")

  os.makedirs(args.workdir, exist_ok=True)
  json_path = os.path.join(args.workdir, "credit_quality.json")
  png_path = os.path.join(args.workdir, "credit_quality.png")
  report = {"task": {"name": task.name, **{f: getattr(task, f) for f in (
                "num_symbols", "depth", "num_decisive", "key_prob", "key_prob_spread",
                "graded")}},
            "rollouts": ROLLOUT_NOTE, "seeds": seeds, "group_sizes": args.group_sizes,
            "num_prompts": args.num_prompts, "max_responses": max_responses,
            "summary": summary, "skipped": runs[0]["skipped"],
            "skipped_at": runs[0]["skipped_at"], "runs": runs, "wall_s": wall_s}
  with open(json_path, "w") as f:
    json.dump(_jsonable(report), f, indent=1)
  plot(summary, args.group_sizes, png_path,
       title=f"token_tree (K={task.num_symbols}, D={task.depth}, m={task.num_decisive}, "
             f"{'graded' if task.graded else 'binary'}), seeds {seeds}")
  print(f"wrote {json_path} and {png_path}")
  return report


if __name__ == "__main__":
  main()
