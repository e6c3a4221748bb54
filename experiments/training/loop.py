"""The shared RL loop: SFT warm start -> (sample -> rewards -> tree -> credit -> update)*.

    params0 = loop.sft(cfg, workdir + '/sft')              # cached in its workdir
    summary = loop.train(cfg, workdir + '/run', params0, method='tempo:iid')

Each RL step i (all randomness from `fold_in(key(rl.seed), i)`, so a run is a
function of (config, step) and resuming is exact):
  prompts = task.sample(...)                        [B, P]
  samples = sampler(params, prompts)                Samples [B, G, L]
  rewards = task.reward(...)                        [B, G]
  old/ref logprobs by teacher forcing               [B, G, L]  (ratio exactly 1 at first)
  advantages = credit.get(name)(Rollouts(..., tree=trees.from_forks(...) for tree samplers))
  loss mask = credit.loss_mask(name, ...)            (the sampled mask for most estimators)
  state, metrics = train_step(state, batch)
Optional Rollouts inputs are computed only when the estimator `needs` them
(`credit.needs(name)`), so the default path costs nothing extra:
  entropy           the sampler's untempered next-token entropy (`Samples.entropy`; JAX and
                    text tasks); multi-turn samples carry none: a teacher-forced pass
                    (shared with the old log-probs when rl.recompute_logprobs), policy tokens only
  prompt_logprobs   [B, P] one teacher-forced pass over the prompts (`prompt_logprobs`)
  context_logprobs  one teacher-forced pass with the prompt changed (`context_prompts`)
  saliency          one extra backward pass (`experiments/training/saliency.py`)
  step_probes       S + 1 teacher-forced passes scoring the gold continuation after each
                    reasoning step (`experiments/training/probes.py`; JAX CoT tasks)
  hindsight_logprobs  one teacher-forced pass with the task's gold answer after the prompt
                    (`experiments/training/hindsight.py`; JAX CoT tasks); `self_hindsight`:
                    with each group's modal answer instead (SIOP)
  interventions     InT's fine-tuning phase before the first RL step
                    (`experiments/training/interventions.py`; scratch_add)
  expert_sft        DistIL: after each update, one SFT step (its own Adam) on the same
                    interventions of this step's responses
A stateful estimator (`credit.stateful(name)`) gets its state (`credit.init_state`) in
`Rollouts.credit_state`; after the advantages the loop computes `credit.update_state` in
the same jitted call, commits it with the update, logs its scalar leaves as
`credit_state/<path>` and checkpoints it with the train state, so resuming is exact.
The task side is a *problem*: `JaxProblem` (a JAX task, below),
`rollouts.text_rollouts.TextProblem` (a text task on a pretrained model, host-scored) or
`rollouts.agent_rollouts.AgentProblem` (a multi-turn environment: the problem samples its
own episodes, supplies the turn structure, and the step logs environment steps too).
Logs one JSON line per step to <workdir>/metrics.jsonl (step, wall_s, method, timings,
throughput, losses, and greedy_acc / pass@k every eval.every steps), saves orbax
checkpoints to <workdir>/checkpoints/ (every rl.ckpt_every steps, at the end and on
Ctrl-C) together with a config fingerprint; a checkpoint whose fingerprint differs
is refused. `rl.steps`, eval, seeds/methods, quick and progress are not part of
the fingerprint, so a run can be extended by raising `rl.steps`.
"""

import contextlib
import hashlib
import json
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import credit
from experiments.rollouts import knapsack as knapsack_lib
from experiments.training import critic as critic_lib
from experiments.training import hindsight as hindsight_lib
from experiments.training import interventions as interventions_lib
from experiments.training import replay as replay_lib
from experiments.training import saliency as saliency_lib
from experiments.training import train_step as ts
from experiments.training import watchdog
# The loop's public names, importable from here as before the split by job:
from experiments.training.checkpoints import (  # noqa: F401
    _manager, _set_aside, _state_tree, _train_tree, restore_checkpoint, save_checkpoint)
from experiments.training.config_checks import (  # noqa: F401
    FREE_DICTS, IID_SAMPLERS, NOT_FINGERPRINTED, PACKING, SAMPLER_COMMON, SAMPLER_FIELDS,
    SAMPLERS, check_config, fingerprint, group_size, is_agent, is_text, loss_config,
    policy_config, reference_config, run_config)
from experiments.training.forward import (  # noqa: F401
    _node_ids, context_prompts, credit_fn, group_process_rewards, group_rewards, pack_groups,
    packing_applies, packs_evenly, prompt_logprobs, prompt_scored, rows_logprobs)
from experiments.training.methods import method_name, parse_methods, with_method  # noqa: F401
from experiments.training.metrics_io import (  # noqa: F401
    MetricsWriter, read_metrics, state_metrics, summarize)
from experiments.training.problems import (  # noqa: F401
    JaxProblem, build_problem, build_task, evaluate)
from experiments.training.samplers import sample  # noqa: F401
from experiments.training.warm_start import pretrained_start, sft  # noqa: F401


# ----------------------------------------------------------------------------
# RL.


def _off_policy_setup(cfg, problem, pool: int, need_replay: bool, run_seed: int):
  """The empty replay store (None unless the estimator needs replay): fixes the problem's
  prompt pool (`rl.prompt_pool`) and checks what the replay store and the lagged sampler
  need, with errors naming the field."""
  if pool:
    if not hasattr(problem, 'set_pool'):
      raise ValueError(f'rl.prompt_pool = {pool} needs a JAX task (a fixed pool of its '
                       f'prompts); task {cfg.task.name!r} draws its own')
    problem.set_pool(pool, run_seed)
  if cfg.sampler.name == 'lagged' and hasattr(problem, 'sample'):
    raise ValueError("sampler 'lagged' samples single-turn responses; multi-turn environments "
                     "sample with 'iid' or 'tree_turns'")
  if not need_replay:
    return None
  if not pool:
    raise ValueError(f'credit {cfg.credit.name!r} replays stored successes of the same prompt, '
                     f'which needs prompts that recur: set rl.prompt_pool (e.g. 256)')
  if cfg.sampler.name not in ('iid', 'lagged'):
    raise ValueError(f'credit {cfg.credit.name!r} puts a stored response in place of a '
                     f"group's last one, which needs i.i.d. groups (sampler 'iid' or 'lagged'); "
                     f'got {cfg.sampler.name!r}')
  return replay_lib.init_store(pool, problem.response_len, problem.pad_id)


def train(cfg, workdir: str, init_params, method: Optional[str] = None, seed: int = 0,
          progress: Optional[bool] = None) -> dict:
  """RL from `init_params` (also the frozen KL reference) for cfg.rl.steps steps.

  `method` 'credit:sampler' overrides cfg.credit.name / cfg.sampler.name; `seed`
  is added to rl.seed. Resumes from <workdir>/checkpoints if present. Returns a
  summary dict (final and peak eval metrics, mean timings; the final params, and with the
  sampler 'experience' the experience library).
  """
  if method is not None:
    cfg = with_method(cfg, method)
  check_config(cfg)
  credit.check_hparams(cfg.credit.name, dict(cfg.credit.hparams))
  method = method or f'{cfg.credit.name}:{cfg.sampler.name}'
  progress = cfg.progress if progress is None else progress
  problem = build_problem(cfg)
  pcfg = problem.pcfg
  loss_cfg = loss_config(cfg)
  run_seed = cfg.rl.seed + seed
  fp, flat = fingerprint(run_config(cfg, run_seed))
  flat['init_params_sum'] = float(sum(float(jnp.sum(x)) for x in jax.tree.leaves(init_params)))
  fp = hashlib.sha1((fp + repr(flat['init_params_sum'])).encode()).hexdigest()

  mesh = ts.make_mesh(cfg.mesh.fsdp, model=cfg.mesh.get('model', 1))
  ts.check_model_axis(pcfg, ts.mesh_axis(mesh, 'model'))  # a clear error, before any work
  o = cfg.optimizer
  tx = ts.make_optimizer(o.lr, o.warmup_steps, o.weight_decay, o.grad_clip, o.b1, o.b2,
                         lora_only=pcfg.lora_rank > 0)
  state = ts.shard_state(ts.init_state(jax.tree.map(jnp.copy, init_params), tx, seed=run_seed),
                         mesh)  # so a checkpoint restores straight onto the mesh
  hparams_json = json.dumps(cfg.credit.hparams.to_dict() if hasattr(cfg.credit.hparams, 'to_dict')
                            else dict(cfg.credit.hparams), sort_keys=True)
  hparams = json.loads(hparams_json)
  needs = credit.needs(cfg.credit.name)
  stateful = credit.stateful(cfg.credit.name)
  # A stateful estimator's state (pass-rate EMAs, curricula, ...): carried and checkpointed.
  credit_state = (jax.tree.map(jnp.asarray, credit.init_state(cfg.credit.name, **hparams))
                  if stateful else None)
  # A learned critic (PPO's GAE), only when the estimator reads values: its own train state.
  need_values = 'values' in needs
  critic_state, ccfg, critic_gl = (
      critic_lib.from_config(cfg, init_params, pcfg, run_seed, mesh)
      if need_values else (None, None, None))
  mngr = _manager(os.path.join(workdir, 'checkpoints'))
  watchdog.register_checkpoints(os.path.join(workdir, 'checkpoints'))  # named if a peer dies
  # A finite prompt pool, R3's replay store and off-policy GRPO's lagged behaviour policy
  # (experiments/training/replay.py): the store and the lagged params are checkpointed.
  pool, scfg = int(cfg.rl.get('prompt_pool', 0)), cfg.sampler
  need_replay, lag = 'replay' in needs, int(scfg.lag) if scfg.name == 'lagged' else 0
  replay_store = _off_policy_setup(cfg, problem, pool, need_replay, run_seed)
  behaviour = replay_lib.copy_params(state.params) if lag else None
  # Knapsack RL: each pool prompt's pass rate at its last visit (-1: not yet), loop state.
  knapsack = scfg.name == 'knapsack'
  if knapsack and (not pool or hasattr(problem, 'sample')):
    raise ValueError("sampler 'knapsack' allocates each step's rollouts by the prompts' pass "
                     "rates at their last visit, which needs a single-turn JAX task with "
                     "prompts that recur: set rl.prompt_pool (e.g. 256)")
  pass_rate = jnp.full((pool,), -1.0, jnp.float32) if knapsack else None
  # SLEA-RL: the step-level experience library (envs/experience.py), loop state.
  experience = scfg.name == 'experience'
  if experience and not hasattr(problem, 'learn'):
    raise ValueError("sampler 'experience' (SLEA-RL) retrieves experiences at every turn of "
                     "a multi-turn environment (configs/agents.py, agent.experience_slots)")
  library = problem.empty_library() if experience else None
  replay_kw = dict(success=float(hparams.get('success', 1.0)),
                   two_sided='replay_failures' in needs)
  replay_current = hparams.get('replay_logprobs', 'behaviour') == 'current'
  # DistIL: an SFT step toward the expert at the learner's first wrong step, after each
  # update, with its own Adam (its moments are loop state).
  need_expert = 'expert_sft' in needs
  if need_expert and not hasattr(getattr(problem, 'task', None), 'interventions'):
    raise ValueError(f'credit {cfg.credit.name!r} imitates the expert at the learner\'s '
                     f'first wrong step, which needs a task that builds single-step '
                     f'interventions (scratch_add); task {cfg.task.name!r} does not')
  expert_tx = ts.make_optimizer(float(hparams.get('expert_lr', 3e-4))) if need_expert else None
  expert_opt = expert_tx.init(state.params) if need_expert else None
  restored, meta, aux = restore_checkpoint(mngr, state, fp, flat, dict(
      credit_state=credit_state, critic=critic_state, replay=replay_store, behaviour=behaviour,
      expert_opt=expert_opt, pass_rate=pass_rate, library=library))
  credit_state, critic_state = aux['credit_state'], aux['critic']
  replay_store, behaviour, expert_opt = aux['replay'], aux['behaviour'], aux['expert_opt']
  pass_rate, library = aux['pass_rate'], aux['library']

  def lib_kw():  # the current library (restored, then each step's), for sampling and eval
    return dict(library=library) if experience else {}

  if need_values:
    critic_state = ts.shard_state(critic_state, mesh)
  start, wall0 = 0, 0.0
  if restored is not None:
    state, start, wall0 = restored, meta['rl_step'], meta['wall_s']
  phase_info = {}
  if 'interventions' in needs and restored is None:  # InT: fine-tune on fixed failures first
    sample_fn = lambda params, k, draw: sample(params, pcfg, problem, scfg, k, draw.prompts,
                                               prompt_ids=draw.prompt_ids)
    params, phase_info = interventions_lib.phase(
        state.params, problem, sample_fn, jax.random.fold_in(jax.random.PRNGKey(run_seed), 7),
        steps=int(hparams.get('intervention_steps', 10)), batch=cfg.rl.prompts_per_step,
        lr=float(hparams.get('intervention_lr', 3e-4)))
    state = state.replace(params=params)
  state = ts.shard_state(state, mesh)
  ref_params = jax.device_put(init_params, ts.param_sharding(init_params, mesh))  # as policy
  writer = MetricsWriter(os.path.join(workdir, 'metrics.jsonl'),
                         start if restored is not None else None)
  old_rows = writer.rows  # the rows up to the restored step (a torn final line dropped)
  gen_total = max([r.get('generated_tokens_total', 0.0) for r in old_rows] + [0.0])
  gen_total += phase_info.get('intervention_generated_tokens', 0.0)  # InT's phase samples
  env_steps_total = max([r.get('env_steps_total', 0.0) for r in old_rows] + [0.0])
  b = cfg.rl.prompts_per_step
  est = credit_fn(cfg.credit.name, hparams_json, scfg.name not in IID_SAMPLERS, stateful)
  need_ref = loss_cfg.needs_ref or 'ref_logprobs' in needs  # KL loss/reward, APA's anchor
  need_entropy, need_prompt_lp = 'entropy' in needs, 'prompt_logprobs' in needs
  need_context, need_saliency = 'context_logprobs' in needs, 'saliency' in needs
  need_hindsight = 'hindsight_logprobs' in needs
  need_self_hindsight = 'self_hindsight' in needs  # with step_ends: a JAX CoT task (below)
  if need_hindsight and not (hasattr(problem, 'hindsight_prompts') and hasattr(
      getattr(problem, 'task', None), 'reasoning_steps')):
    raise ValueError(f'credit {cfg.credit.name!r} scores the responses with the gold answer '
                     f'in context, which needs a JAX chain-of-thought task with '
                     f'demonstrations and `reasoning_steps` (scratch_add, countdown_steps); '
                     f'task {cfg.task.name!r} has none')
  saliency_kw = dict(kind=hparams.get('saliency_kind', 'grad_norm'),
                     answer_tokens=int(hparams.get('answer_tokens', 0)))
  # Old / reference log-probs run over the batch in the update step's parts (rows_logprobs).
  lp_chunks = loss_cfg.num_minibatches * loss_cfg.num_microbatches
  need_process = bool({'token_rewards', 'step_ends'} & set(needs))
  if need_process and not hasattr(problem, 'process_rewards'):
    raise ValueError(f'credit {cfg.credit.name!r} needs per-step process rewards, which text '
                     f'tasks and multi-turn environments do not provide; use a JAX '
                     f'chain-of-thought task (scratch_add, countdown_steps)')
  if need_process and not hasattr(problem.task, 'token_rewards'):
    raise ValueError(f'credit {cfg.credit.name!r} needs per-step process rewards '
                     f'(token_rewards, step_ends), which task {cfg.task.name!r} does not '
                     f'provide; use a chain-of-thought task (scratch_add, countdown_steps)')
  need_probes = 'step_probes' in needs
  if need_probes and not hasattr(getattr(problem, 'task', None), 'reasoning_steps'):
    raise ValueError(f'credit {cfg.credit.name!r} probes the gold continuation after each '
                     f'reasoning step, which needs a JAX chain-of-thought task with '
                     f'demonstrations and `reasoning_steps` (scratch_add, countdown_steps); '
                     f'task {cfg.task.name!r} has none')
  if 'turns' in credit.needs(cfg.credit.name) and not hasattr(problem, 'turns'):
    raise ValueError(f'credit {cfg.credit.name!r} assigns credit to the turns of multi-turn '
                     f'trajectories; task {cfg.task.name!r} is single-turn (use a multi-turn '
                     f'environment, configs/agents.py)')
  n_dev = ts.row_shards(mesh)  # devices that hold different rows ('model' repeats them)
  use_packing, pack_len = packing_applies(cfg, b, n_dev), 0
  key = jax.random.PRNGKey(run_seed)
  t_start = time.time() - wall0
  step = start

  def meta_now():
    return dict(fingerprint=fp, config=flat, rl_step=step, wall_s=time.time() - t_start,
                method=method)

  def checkpoint():  # the train, credit and critic states after `step`, together
    save_checkpoint(mngr, step, state, meta_now(), dict(
        credit_state=credit_state, critic=critic_state, replay=replay_store, behaviour=behaviour,
        expert_opt=expert_opt, pass_rate=pass_rate, library=library))

  bar = tqdm(range(start, cfg.rl.steps), desc=f'RL {method} s{seed}', disable=not progress,
             initial=start, total=cfg.rl.steps, leave=False)
  last_eval, pending, dirty = {}, None, False
  try:
    if start == 0:  # eval of the starting policy, logged as step 0
      last_eval = problem.evaluate(state.params, cfg.eval, **lib_kw())
      writer.write(dict(step=0, wall_s=0.0, method=method, seed=seed, **last_eval,
                        **phase_info))
    for i in bar:
      k = jax.random.fold_in(key, i)
      t0 = time.perf_counter()
      pending = None
      draw = problem.draw(jax.random.fold_in(k, 0), i, b)
      prompts, plen = draw.prompts, draw.prompt_len
      if b % n_dev == 0:
        # Every process drew the whole batch (same key); each feeds its devices' rows.
        prompts, plen = ts.host_batch_to_global((prompts, plen), mesh)
      if lag and i % lag == 0:  # off-policy GRPO: the behaviour policy catches up
        behaviour = replay_lib.copy_params(state.params)
      sampling_params = behaviour if lag else state.params
      sizes = None
      if knapsack:  # Knapsack RL: each prompt's rollouts from its pass rate, B·G in all
        sizes = knapsack_lib.allocate(
            np.asarray(pass_rate)[np.asarray(draw.prompt_ids)], b * scfg.group_size,
            default=scfg.group_size, min_rows=scfg.min_group, max_rows=scfg.max_group)
      if hasattr(problem, 'sample'):  # multi-turn episodes (the problem's own sampler)
        samples = problem.sample(state.params, scfg, jax.random.fold_in(k, 1), draw, **lib_kw())
      else:  # on a mesh of > 1 device, rows of the KV cache split over it (place_rows)
        with jax.set_mesh(mesh) if mesh.size > 1 else contextlib.nullcontext():
          samples = sample(sampling_params, pcfg, problem, scfg, jax.random.fold_in(k, 1),
                           prompts, prompt_ids=draw.prompt_ids, prompt_len=plen,
                           info=draw.handle, progress=i / cfg.rl.steps, group_sizes=sizes)
      rewards, reward_metrics = problem.rewards(draw, samples)
      row_mask = getattr(samples, 'row_mask', None)  # groups of varying size (knapsack)
      if row_mask is not None:
        rewards = jnp.where(row_mask, rewards, 0.0)
      fresh_rewards, replayed = rewards, None
      if need_replay:  # R3 / AVATAR: a stored response of the prompt into each collapsed group
        samples, rewards, replayed = replay_lib.inject(replay_store, draw.prompt_ids, samples,
                                                       rewards, **replay_kw)
      rewards.block_until_ready()
      t1 = time.perf_counter()
      packed = None
      if use_packing:
        packed = pack_groups(cfg.train, prompts, samples, plen, pack_len)
        pack_len = packed.pack_len
      policy_mask = getattr(samples, 'policy_mask', None)
      entropy = getattr(samples, 'entropy', None) if need_entropy else None
      tf_entropy = need_entropy and entropy is None  # multi-turn: from a teacher-forced pass
      if cfg.rl.recompute_logprobs:  # teacher-forced: ratio exactly 1 at the first update
        old_lp = rows_logprobs(sampling_params, prompts, samples.tokens, samples.mask, plen,
                               packed, cfg=pcfg, chunks=lp_chunks, with_entropy=tf_entropy)
        if tf_entropy:
          old_lp, entropy = old_lp
      else:  # the sampler's untempered log-probs (same params; equal up to float rounding)
        old_lp = samples.logprobs
        if tf_entropy:
          entropy = rows_logprobs(state.params, prompts, samples.tokens, samples.mask, plen,
                                  packed, cfg=pcfg, chunks=lp_chunks, with_entropy=True)[1]
      if replayed is not None:  # replayed rows: their behaviour log-probs, or the current's
        keep = (rows_logprobs(state.params, prompts, samples.tokens, samples.mask, plen, None,
                              cfg=pcfg, chunks=lp_chunks) if replay_current
                else samples.logprobs)
        old_lp = jnp.where(replayed[..., None], keep, old_lp)
      if tf_entropy and policy_mask is not None:  # the policy's own steps only
        entropy = jnp.where(policy_mask, entropy, 0.0)
      extra = dict(entropy=entropy, row_mask=row_mask)
      if need_prompt_lp:
        extra['prompt_logprobs'] = prompt_logprobs(state.params, prompts, plen, cfg=pcfg)
        extra['prompt_mask'] = prompt_scored(plen, prompts.shape[1], prompts.shape[0])
      if need_context:  # one teacher-forced pass with the prompt changed (flat rows)
        ctx_prompts, ctx_plen = context_prompts(problem, draw, prompts, plen)
        ctx = rows_logprobs(state.params, ctx_prompts, samples.tokens, samples.mask, ctx_plen,
                            None, cfg=pcfg, chunks=lp_chunks)
        extra['context_logprobs'] = (ctx if policy_mask is None
                                     else jnp.where(policy_mask, ctx, 0.0))
      if need_hindsight:  # one teacher-forced pass with the gold answer after the prompt
        hs_prompts, hs_plen = problem.hindsight_prompts(draw, prompts, plen)
        extra['hindsight_logprobs'] = rows_logprobs(
            state.params, hs_prompts, samples.tokens, samples.mask, hs_plen, None, cfg=pcfg,
            chunks=lp_chunks)
      if need_saliency:  # one extra backward pass
        extra['saliency'] = saliency_lib.token_saliency(
            state.params, prompts, samples.tokens, samples.mask, plen, policy_mask, cfg=pcfg,
            chunks=lp_chunks, **saliency_kw)
      if stateful:
        extra['credit_state'] = credit_state
      critic_s = 0.0
      if need_values:  # the critic's V(s_t) before each token: one forward (flat rows)
        tc = time.perf_counter()
        extra['values'] = critic_lib.group_values(critic_state.params, prompts, samples.tokens,
                                                  plen, cfg=pcfg)
        extra['values'].block_until_ready()
        critic_s += time.perf_counter() - tc
      ref_lp = (rows_logprobs(ref_params, prompts, samples.tokens, samples.mask, plen, packed,
                              cfg=pcfg, chunks=lp_chunks) if need_ref else None)
      train_rewards = rewards
      if need_ref and loss_cfg.kl_in_reward:
        train_rewards = rewards - loss_cfg.kl_coef * jnp.sum(
            credit.kl_k1(old_lp, ref_lp, samples.mask), -1)
      old_lp.block_until_ready()
      t2 = time.perf_counter()
      process = problem.process_rewards(draw, samples) if need_process else (None, None)
      probe_s = {}
      if need_probes:  # S + 1 teacher-forced passes scoring the gold continuation
        tp = time.perf_counter()
        extra['step_probes'] = problem.step_probes(state.params, draw, samples, process[1])
        credit.validate(credit.Rollouts(  # on the host: a NaN probe is named, not trained on
            tokens=samples.tokens, mask=samples.mask, rewards=rewards,
            step_probes=extra['step_probes']))
        probe_s = dict(probe_s=time.perf_counter() - tp)
      if need_self_hindsight:  # SIOP: the hindsight pass with each group's modal answer
        tp = time.perf_counter()
        mode_prompts, mode_plen = hindsight_lib.modal_answer_prompts(
            prompts, plen, samples.tokens, samples.mask, process[1], pad_id=problem.pad_id)
        extra['hindsight_logprobs'] = rows_logprobs(
            state.params, mode_prompts, samples.tokens, samples.mask, mode_plen, None,
            cfg=pcfg, chunks=lp_chunks)
        probe_s = dict(probe_s=time.perf_counter() - tp)
      turns = (problem.turns(state.params, draw, samples, credit.needs(cfg.credit.name))
               if hasattr(problem, 'turns') else None)
      if turns is not None:  # values are checked on the host: `est` is jitted (tracers)
        credit.validate_turns(turns, samples)
      out = est(samples.tokens, samples.mask, train_rewards, samples.parent, samples.fork,
                old_lp, ref_lp, *process, policy_mask=policy_mask, turns=turns, **extra)
      adv, loss_mask = out[:2]
      next_credit_state = out[2] if stateful else None  # committed with the update below
      adv.block_until_ready()
      t3 = time.perf_counter()
      batch = ts.batch_from_samples(prompts, samples.tokens, loss_mask, adv, old_lp, ref_lp,
                                    plen, packed)
      if (b if packed is not None else batch.tokens.shape[0]) % n_dev == 0:
        batch = ts.shard_batch(batch, mesh)
      next_critic, cm = critic_state, {}
      if need_values:  # regression on TD(λ) returns (verl: returns = A^GAE + V)
        tc = time.perf_counter()
        next_critic, cm = critic_lib.update_on_samples(
            critic_state, prompts, plen, samples, extra['values'], train_rewards, process[0],
            policy_mask, mesh, pcfg=pcfg, ccfg=ccfg, gamma_lam=critic_gl)
        critic_s += time.perf_counter() - tc
      next_rate = (knapsack_lib.update_pass_rates(pass_rate, draw.prompt_ids, rewards, row_mask)
                   if knapsack else None)
      next_library, exp_m = (problem.learn(library, samples, scfg) if experience
                             else (None, {}))
      next_store = (replay_lib.update(replay_store, draw.prompt_ids, samples, rewards, replayed,
                                      step=i, **replay_kw) if need_replay else None)
      # From the donating update to the commit below, `state` and the loop state are not one
      # step's: an interrupt there keeps the last checkpoint (see KeyboardInterrupt below).
      dirty = True
      if need_values and i < ccfg.critic_warmup:  # verl's critic_warmup: the critic alone
        m = dict(critic_warmup=1.0)
      else:
        state, m = ts.train_step_jit(state, batch, cfg=pcfg, loss_cfg=loss_cfg)
      next_expert = expert_opt
      if need_expert:  # DistIL: forward cross-entropy to the expert at the learner's states
        e_prompts, e_tokens, e_mask, e_ok = problem.interventions(draw, samples)
        m['expert_rows'] = float(jnp.sum(e_ok))
        if m['expert_rows'] > 0:
          es, em = ts.sft_step_jit(  # donates its state: the policy's params (replaced
              ts.TrainState(params=state.params, opt_state=expert_opt,  # below), fresh rest
                            step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(0),
                            tx=expert_tx), e_prompts, e_tokens, e_mask, cfg=pcfg)
          state, next_expert, m['expert_loss'] = (state.replace(params=es.params),
                                                  es.opt_state, em['loss'])
      # `state` is now the state after this step (the old one was donated); the credit,
      # critic and replay states after it are committed with it, in one statement.
      step, credit_state, critic_state, replay_store, expert_opt, pass_rate, library, dirty = (
          i + 1, next_credit_state if stateful else None, next_critic, next_store, next_expert,
          next_rate, next_library, False)
      m.update(cm)
      m.update(exp_m)
      pending = dict(step=step, wall_s=time.time() - t_start, method=method, seed=seed,
                     interrupted=True)
      m = {k_: float(v) for k_, v in m.items()}
      t4 = time.perf_counter()
      ntok = float(jnp.sum(getattr(samples, 'policy_mask', samples.mask)))  # trained tokens
      if hasattr(samples, 'hint_len'):  # the 'hinted' sampler: reference tokens given
        m['hint_tokens'] = float(jnp.sum(samples.hint_len))
      if hasattr(samples, 'generated_tokens'):  # multi-turn: copied turns are not generated
        gen = float(samples.generated_tokens)
        steps_now = float(samples.env_steps)
        env_steps_total += steps_now
        counts = dict(env_steps=steps_now, env_steps_total=env_steps_total,
                      env_steps_per_s=steps_now / (t1 - t0))
      else:
        gen = ntok - float(jnp.sum(jnp.where(samples.parent >= 0, jnp.minimum(  # forks' copied
            samples.fork, samples.lengths), 0)))  # prefixes are not generated; i.i.d.: fork 0
        counts = {}
        if replayed is not None:  # replayed responses were generated at an earlier step
          gen -= float(jnp.sum(jnp.where(replayed, samples.lengths, 0)))
          counts = dict(replayed_groups=float(jnp.sum(replayed)))
        if knapsack:
          counts = dict(group_size_min=float(sizes.min()), group_size_max=float(sizes.max()))
      gen_total += gen
      r = ts.host_value(rewards)  # all rows, on every process (trained: replayed included)
      rows = None if row_mask is None else ts.host_value(row_mask)
      fresh = ts.host_value(fresh_rewards)
      group_signal, row_signal = knapsack_lib.signal(r, rows)
      row = dict(step=step, wall_s=time.time() - t_start, method=method, seed=seed,
                 generated_tokens=gen, generated_tokens_total=gen_total, **counts,
                 reward=float(fresh.mean() if rows is None  # this step's samples
                              else fresh[rows].mean()),
                 frac_groups_with_signal=group_signal, frac_rows_with_signal=row_signal,
                 response_len=ntok / (r.size if rows is None else rows.sum()), **m,
                 sample_s=t1 - t0, logprob_s=t2 - t1, credit_s=t3 - t2, update_s=t4 - t3,
                 step_s=t4 - t0, sampled_tokens_per_s=ntok / (t1 - t0),
                 train_tokens_per_s=ntok * loss_cfg.num_epochs / (t4 - t3),
                 credit_frac=(t3 - t2) / (t4 - t0), **probe_s, **reward_metrics,
                 **({'critic_s': critic_s} if need_values else {}),
                 **(state_metrics(credit_state) if stateful else {}))
      pending = row  # update applied, row not yet written (see KeyboardInterrupt below)
      if step % cfg.eval.every == 0 or step == cfg.rl.steps:
        last_eval = problem.evaluate(state.params, cfg.eval, **lib_kw())
        row.update(last_eval)
      writer.write(row)
      pending = None
      bar.set_postfix(reward=f'{row["reward"]:.2f}',
                      acc=f'{last_eval.get("greedy_acc", float("nan")):.2f}')
      if step % cfg.rl.ckpt_every == 0 or step == cfg.rl.steps:
        checkpoint()
  except KeyboardInterrupt:
    if pending is not None:  # interrupted during eval: keep the update, log it without eval
      writer.write(pending)
    if not dirty and mngr.latest_step() != step:
      checkpoint()
    saved = mngr.latest_step()
    mngr.close()
    print(f'\nInterrupted{" during an update" if dirty else ""}: {workdir}/checkpoints holds '
          f'step {saved}; rerun to resume from there.' if saved is not None else
          f'\nInterrupted before the first checkpoint; rerun to start over.')
    raise
  mngr.close()
  out = summarize(read_metrics(os.path.join(workdir, 'metrics.jsonl')), cfg.eval.pass_k,
                  params=state.params)
  if experience:  # SLEA-RL's library after the last step, beside the params
    out['library'] = library
  return out
