"""Every input surface refuses garbage with a ValueError that names it (issue 20):
turn estimators (credit.agents, concrete and under jit), tree packing
(trees.packing.pack) and run configs (loop.check_config)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import credit
from credit import agents
from credit.turns import Turns, turn_to_tokens, validate_turns
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

B, G, K = 2, 4, 3  # one shape: each estimator compiles once under jit
NAMES = tuple(agents.AGENT_ESTIMATORS)
READS_REWARDS = NAMES  # cast too: its outcome term (GRPO of the returns)
JITTED = {name: jax.jit(fn) for name, fn in agents.AGENT_ESTIMATORS.items()}
# CAST's value-difference form reads values_star one trajectory at a time.
CAST_VALUES = jax.jit(lambda t: agents.cast(t, **agents.CAST_VALUE_DIFFERENCE))


def make_turns(seed=0, lengths=((3, 2, 1, 0), (3, 3, 2, 1))):
  """Turns [B, G, K] with ragged lengths, dense rewards, values_star, solver_steps and
  answer_logprobs."""
  rng = np.random.default_rng(seed)
  mask = np.arange(K) < np.asarray(lengths)[..., None]
  ids = rng.integers(0, 3, (B, G, K + 1)).astype(np.int32)
  ids[..., 0] = 0
  rewards = np.where(mask, rng.normal(size=(B, G, K)), np.nan).astype(np.float32)
  values = rng.normal(size=(B, G, K + 1)).astype(np.float32)
  logprobs = np.log(rng.uniform(0.05, 1.0, (B, G, K + 1))).astype(np.float32)
  token_turn = np.repeat(np.arange(K), 2)[None, None] * np.ones((B, G, 1), np.int32)
  token_turn = np.where(token_turn < np.asarray(lengths)[..., None], token_turn, -1)
  return Turns(state_ids=ids, rewards=rewards, turn_mask=mask, token_turn=token_turn.astype(
      np.int32), success=rng.random((B, G)) < 0.5, values_star=values,
               answer_logprobs=logprobs,
               solver_steps=rng.integers(0, 4, (B, G, K + 1)).astype(np.float32))


def rollouts_of(turns):
  mask = np.asarray(turns.token_turn) >= 0
  return credit.Rollouts(tokens=np.zeros(mask.shape, np.int32), mask=mask,
                         rewards=np.zeros(mask.shape[:-1], np.float32), turns=turns)


def with_value(turns, field, index, value):
  x = np.array(getattr(turns, field))
  x[index] = value
  return turns.replace(**{field: x})


def entry_points(name):
  """The three ways to call a turn estimator: turn level, token level, the registry."""
  return {"turns": lambda t: agents.AGENT_ESTIMATORS[name](t),
          "tokens": lambda t: agents.AGENT_TOKEN_ESTIMATORS[name](rollouts_of(t), t),
          "registry": lambda t: credit.get(name)(rollouts_of(t))}


# --------------------------------------------------------------------------- Turns


def test_validate_turns_checks_state_values_on_visited_states_only():
  turns = make_turns()
  validate_turns(turns)
  # trajectory (0, 1) takes 2 turns: states 0..2 are visited, state 3 is padding.
  for field in ("values_star", "answer_logprobs"):
    for bad in (np.nan, np.inf):
      with pytest.raises(ValueError, match=rf"{field}\[0, 1, 2\]"):
        validate_turns(with_value(turns, field, (0, 1, 2), bad))
    validate_turns(with_value(turns, field, (0, 1, 3), np.nan))  # past n_g: never read
    validate_turns(with_value(turns, field, (0, 3, 0), np.nan))  # n_g = 0: nothing read
  with pytest.raises(ValueError, match=r"values_star must be finite"):
    validate_turns(with_value(turns, "values_star", (1, 0, 0), -np.inf))
  validate_turns(with_value(turns, "answer_logprobs", (1, 0, 0), -np.inf))  # log 0 is fine
  with pytest.raises(ValueError, match="values_star must be real"):
    validate_turns(turns.replace(values_star=np.zeros((B, G, K + 1), bool)))


@pytest.mark.parametrize("name", NAMES)
def test_every_turn_estimator_refuses_malformed_turns(name):
  """Each entry point of each estimator raises on concrete garbage instead of computing."""
  turns = make_turns()
  hole = np.array(turns.turn_mask)
  hole[0, 0] = (True, False, True)
  cases = [(turns.replace(turn_mask=hole), "run from turn 0"),
           (with_value(turns, "token_turn", (0, 0, 5), K), r"in \[-1, K\)"),
           (with_value(turns, "token_turn", (0, 0, 0), -2), r"in \[-1, K\)")]
  if name in READS_REWARDS:
    cases += [(with_value(turns, "rewards", (1, 2, 1), np.nan), "rewards must be finite"),
              (with_value(turns, "rewards", (1, 2, 1), -np.inf), "rewards must be finite")]
  if name == "cast":
    cases += [(with_value(turns, "values_star", (1, 2, 1), np.nan), "values_star"),
              (with_value(turns, "solver_steps", (1, 2, 1), np.inf), "solver_steps")]
  if name == "igpo":
    cases.append((with_value(turns, "answer_logprobs", (1, 2, 1), np.nan), "answer_logprobs"))
  for label, call in entry_points(name).items():
    call(turns)  # the clean input passes
    for bad, message in cases:  # turn level too: it validates token_turn when it is there
      with pytest.raises(ValueError, match=message):
        call(bad)


def test_state_values_given_as_arguments_are_validated():
  turns = make_turns().replace(values_star=None, answer_logprobs=None, solver_steps=None)
  values = np.array(make_turns().values_star)
  values[1, 0, 2] = np.nan
  with pytest.raises(ValueError, match=r"values_star\[1, 0, 2\]"):
    agents.cast(turns, values_star=values, **agents.CAST_VALUE_DIFFERENCE)
  steps = np.array(make_turns().solver_steps)
  steps[0, 1, 1] = np.nan
  with pytest.raises(ValueError, match=r"solver_steps\[0, 1, 1\]"):
    agents.cast(turns, solver_steps=steps)
  logprobs = np.array(make_turns().answer_logprobs)
  logprobs[1, 0, 1] = np.inf
  with pytest.raises(ValueError, match=r"answer_logprobs\[1, 0, 1\]"):
    agents.igpo(turns, answer_logprobs=logprobs)


def test_token_turn_beyond_k_is_refused_not_clipped():
  values = np.arange(1.0, K + 1.0, dtype=np.float32)[None]  # [1, K]
  with pytest.raises(ValueError, match=r"token_turn\[0, 1\] = 3"):
    turn_to_tokens(values, np.array([[0, K]], np.int32))
  jitted = jax.jit(turn_to_tokens)(values, jnp.array([[-1, 0, K - 1, K, -2]], jnp.int32))
  np.testing.assert_array_equal(jitted, [[0.0, 1.0, K, np.nan, np.nan]])  # never turn K - 1's


@settings(max_examples=12, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(B,)), st.integers(0, 2**31 - 1),
       st.sampled_from([np.nan, np.inf, -np.inf]))
def test_non_finite_reward_raises_and_is_never_zero_under_jit(group, seed, bad):
  """A non-finite reward on a taken turn: ValueError from every estimator that reads rewards;
  under jit (where nothing can be raised) NaN on that trajectory (inf for GiGPO's
  group of one), never a finite number, and the other
  group's advantages are exactly those of the clean input."""
  ids, rewards, mask, success = group
  assume(mask.any())
  rng = np.random.default_rng(seed)
  b, g, k = (int(i) for i in np.argwhere(mask)[rng.integers(0, mask.sum())])
  clean = Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success,
                answer_logprobs=np.log(rng.uniform(0.05, 1.0, ids.shape)).astype(np.float32),
                solver_steps=rng.integers(0, 4, ids.shape).astype(np.float32))
  dirty = with_value(clean, "rewards", (b, g, k), bad)
  for name in READS_REWARDS:
    with pytest.raises(ValueError, match="rewards must be finite"):
      agents.AGENT_ESTIMATORS[name](dirty)
    out, ref = np.asarray(JITTED[name](dirty)), np.asarray(JITTED[name](clean))
    assert not np.isfinite(out[b, g, :k + 1]).all(), (name, out[b, g])  # NaN (or inf)
    np.testing.assert_array_equal(out[1 - b], ref[1 - b], err_msg=name)


@settings(max_examples=12, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(B,)), st.integers(0, 2**31 - 1))
def test_nan_state_values_raise_and_are_never_zero_under_jit(group, seed):
  """NaN in values_star (cast's value-difference form), solver_steps (its recipe) or
  answer_logprobs (igpo) on a state the estimator reads."""
  ids, rewards, mask, success = group
  rng = np.random.default_rng(seed)
  n = mask.sum(-1)
  clean = Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success,
                values_star=rng.normal(size=ids.shape).astype(np.float32),
                answer_logprobs=np.log(rng.uniform(0.05, 1.0, ids.shape)).astype(np.float32))
  # cast reads V* of states 0 .. n_g (n_g >= 1); igpo reads p of states 0 .. n_g - 1 (n_g >= 2).
  for name, field, reads in (("cast", "values_star", np.arange(K + 1) <= n[..., None]),
                             ("igpo", "answer_logprobs", np.arange(K + 1) < n[..., None])):
    reads = reads & (n[..., None] >= (1 if name == "cast" else 2))
    if not reads.any():
      continue
    b, g, j = (int(i) for i in np.argwhere(reads)[rng.integers(0, reads.sum())])
    dirty = with_value(clean, field, (b, g, j), np.nan)
    with pytest.raises(ValueError, match=field):
      (agents.AGENT_ESTIMATORS[name] if name != "cast" else CAST_VALUES.__wrapped__)(dirty)
    fn = JITTED[name] if name != "cast" else CAST_VALUES
    out, ref = np.asarray(fn(dirty)), np.asarray(fn(clean))
    assert np.isnan(out[b, g]).any(), (name, j, out[b, g])
    np.testing.assert_array_equal(out[1 - b], ref[1 - b], err_msg=name)
  # CAST's recipe normalises its step term over the whole batch: a NaN step count it reads
  # makes the batch NaN under jit, never zeros.
  reads = (np.arange(K + 1) <= n[..., None]) & (n[..., None] >= 1)
  if reads.any():
    b, g, j = (int(i) for i in np.argwhere(reads)[rng.integers(0, reads.sum())])
    steps = clean.replace(solver_steps=rng.integers(0, 4, ids.shape).astype(np.float32))
    out = np.asarray(JITTED["cast"](with_value(steps, "solver_steps", (b, g, j), np.nan)))
    assert np.isnan(out[b, g][mask[b, g]]).all(), out[b, g]


def test_validate_checks_rollouts_turns():
  turns = make_turns()
  credit.validate(rollouts_of(turns))
  with pytest.raises(ValueError, match="rewards must be finite"):
    credit.validate(rollouts_of(with_value(turns, "rewards", (0, 0, 0), np.nan)))


def test_jitted_loop_estimator_skips_value_checks_so_the_loop_validates_on_the_host():
  """`loop.credit_fn` is jitted: it cannot see a NaN reward (tracers), which is why
  `loop.train` runs `credit.validate_turns(turns, samples)` on the host before it."""
  from experiments.training import loop
  turns = with_value(make_turns(), "rewards", (0, 0, 0), np.nan)
  r = rollouts_of(turns)
  fn = loop.credit_fn("gigpo", "{}", False)
  adv, _ = fn(r.tokens, r.mask, r.rewards, None, None, None, None, turns=turns)
  assert np.isnan(np.asarray(adv)[0]).any() and np.isfinite(np.asarray(adv)[1]).all()
  with pytest.raises(ValueError, match=r"rewards\[0, 0, 0\]"):
    validate_turns(turns, r)


@pytest.mark.slow  # ~20 s of CPU (one quick agent step compiles the sampler and eval)
def test_train_refuses_nan_turn_rewards_before_the_update(tmp_path, monkeypatch):
  """loop.train validates the environment's turns on the host each step: a NaN reward on a
  taken turn stops the run with the error instead of reaching the (jitted) estimator."""
  from configs import agents as agents_config
  from experiments.models import decoder
  from experiments.rollouts import agent_rollouts
  from experiments.training import loop
  cfg = agents_config.shrink(agents_config.get_config())
  cfg.progress = False
  cfg.rl.steps = 1
  cfg.eval.update(num_prompts=1, pass_prompts=1, pass_k=1)
  original = agent_rollouts.AgentProblem.turns

  def nan_turns(self, *args, **kwargs):
    turns = original(self, *args, **kwargs)
    first = np.argwhere(np.asarray(turns.turn_mask))[0]
    return turns.replace(rewards=jnp.asarray(turns.rewards).at[tuple(first)].set(jnp.nan))

  monkeypatch.setattr(agent_rollouts.AgentProblem, "turns", nan_turns)
  problem = loop.build_problem(cfg)
  params = decoder.init_params(jax.random.PRNGKey(0), problem.pcfg)
  with pytest.raises(ValueError, match="rewards must be finite"):
    loop.train(cfg, str(tmp_path), params, method="gigpo:iid")


# --------------------------------------------------------------------------- packing

from trees import packing  # noqa: E402

PB, PG, PL, PP = 2, 3, 4, 5  # one packing shape: the layout compiles once


def pack_inputs(seed=0):
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, 9, (PB, PP)).astype(np.int32)
  tokens = rng.integers(0, 3, (PB, PG, PL)).astype(np.int32)
  mask = np.arange(PL) < rng.integers(0, PL + 1, (PB, PG))[..., None]
  return prompts, tokens, mask, np.array([PP, 2], np.int32)


def test_pack_refuses_garbage_layouts():
  prompts, tokens, mask, plen = pack_inputs()
  t = PP + PG * PL
  hole = mask.copy()
  hole[1, 2] = (True, False, True, False)
  node = np.asarray(packing.node_ids(jnp.asarray(tokens), jnp.asarray(mask)))
  cases = [
      (dict(prompt_len=np.array([0, 2], np.int32)), r"prompt_len must be in \[1, P\] = \[1, 5\] .*"
                                                    r"prompt_len\[0\] = 0"),
      (dict(prompt_len=np.array([PP, PP + 1], np.int32)), r"prompt_len\[1\] = 6"),
      (dict(prompt_len=np.array([-3, 2], np.int32)), r"prompt_len\[0\] = -3"),
      (dict(prompt_len=np.int32(3)), r"prompt_len must be \[B\]"),
      (dict(prompt_len=np.array([3, 2, 1], np.int32)), r"prompt_len must be \[B\]"),
      (dict(prompt_len=np.array([3.0, 2.5])), "prompt_len must be integers"),
      (dict(mask=hole), r"mask has holes.*mask\[1, 2, 2\]"),
      (dict(mask=mask.astype(np.int32)), "mask must be boolean"),
      (dict(tokens=tokens.astype(np.float32)), "tokens must be integer"),
      (dict(prompts=prompts[0]), r"prompts must be \[B, P\]"),
      (dict(prompts=prompts[:, :0]), r"prompts must be \[B, P\] with P >= 1"),
      (dict(tokens=tokens[:, :0], mask=mask[:, :0]), "G, L >= 1"),
      (dict(pack_len=float(t)), "pack_len must be a"),
      (dict(pack_len=PP), "must exceed the prompt length"),
      (dict(node=node[..., :-1]), r"node must be int \[B, G, L\]"),
      (dict(node=np.where(mask, 0, node)), r"node ids must be in \[1, N\)"),
      (dict(node=np.where(mask, node, 1)), r"node ids must be in \[1, N\)"),
      (dict(pack_len=PP + 1), "needs .* packed slots"),
  ]
  args = dict(prompts=prompts, tokens=tokens, mask=mask, prompt_len=plen, pack_len=t)
  packing.pack(**args)
  packing.pack(**{**args, "node": node})
  for change, message in cases:
    with pytest.raises(ValueError, match=message):
      packing.pack(**{**args, **change})


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(-2, PP + 2), min_size=PB, max_size=PB), st.integers(0, 2**31 - 1))
def test_pack_accepts_exactly_the_prompt_lengths_in_1_to_p(lengths, seed):
  prompts, tokens, mask, _ = pack_inputs(seed)
  plen = np.array(lengths, np.int32)
  call = lambda: packing.pack(prompts, tokens, mask, plen, pack_len=PP + PG * PL)
  if ((plen >= 1) & (plen <= PP)).all():
    pk = call()
    np.testing.assert_array_equal(pk.prompt_len, plen)
    for b in range(PB):  # response token 0 sits right after the true prompt
      for g in range(PG):
        if mask[b, g, 0]:
          assert pk.positions[b, pk.path[b, g, plen[b]]] == plen[b]
  else:
    with pytest.raises(ValueError, match="prompt_len"):
      call()


def test_pack_under_jit_checks_shapes_only_and_matches_eager():
  prompts, tokens, mask, plen = pack_inputs()
  t = PP + PG * PL
  eager = packing.pack(prompts, tokens, mask, plen, pack_len=t)
  traced = jax.jit(lambda *a: packing.pack(*a, pack_len=t))(prompts, tokens, mask, plen)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"prompt_len must be \[B\]"):  # shapes: still checked
    jax.jit(lambda *a: packing.pack(*a, pack_len=t))(prompts, tokens, mask, plen[:1])


# --------------------------------------------------------------------------- configs

from configs import agents as agents_config  # noqa: E402
from configs import lm as lm_config  # noqa: E402
from configs import tempo as tempo_config  # noqa: E402
from experiments.training import config_rules  # noqa: E402
from experiments.training import loop  # noqa: E402

CONFIGS = {"tempo": tempo_config, "lm": lm_config, "agents": agents_config}
BAD_VALUES = [  # (config, field, value, message)
    ("tempo", "optimizer.lr", -1e-3, r"optimizer.lr must be a number in \(0, inf\); got -0.001"),
    ("tempo", "optimizer.lr", 0.0, "optimizer.lr must be"),
    ("tempo", "optimizer.lr", float("nan"), "optimizer.lr must be"),
    ("tempo", "sft.lr", -1e-3, "sft.lr must be"),
    ("tempo", "rl.steps", -1, r"rl.steps must be a number in \[0, inf\)"),
    ("tempo", "rl.prompts_per_step", 0, "rl.prompts_per_step"),
    ("tempo", "sampler.group_size", 0, "sampler.group_size"),
    ("tempo", "sampler.temperature", 0.0, "sampler.temperature"),
    ("tempo", "sampler.top_p", 0.0, r"sampler.top_p must be a number in \(0, 1\]"),
    ("tempo", "sampler.top_p", 1.5, "sampler.top_p"),
    ("tempo", "sampler.branching", (2, 0), r"sampler.branching .*got \(2, 0\)"),
    ("tempo", "loss.eps_low", -0.1, "loss.eps_low"),
    ("tempo", "loss.eps_high", -0.1, "loss.eps_high"),
    ("tempo", "eval.every", 0, "eval.every"),
    ("tempo", "optimizer.b2", 1.0, r"optimizer.b2 must be a number in \[0, 1\)"),
    ("tempo", "lr_grid", (1e-3, -1e-3), "lr_grid"),
    ("lm", "lm.max_new_tokens", 0, r"lm.max_new_tokens must be a number in \[1, inf\)"),
    ("lm", "lm.truncation", "drop", "lm.truncation must be one of 'score', 'zero'; got 'drop'"),
    ("lm", "lm.dtype", "float16", "lm.dtype must be one of"),
    ("agents", "agent.gamma", 1.5, "agent.gamma"),
    ("agents", "sampler.fork_turn", -1, "sampler.fork_turn"),
]


def _set(cfg, path, value):
  *parents, leaf = path.split(".")
  node = cfg
  for key in parents:
    node = node[key]
  node[leaf] = value


@pytest.mark.parametrize("config, field, value, message", BAD_VALUES)
def test_check_config_refuses_invalid_values(config, field, value, message):
  cfg = CONFIGS[config].get_config()
  loop.check_config(cfg)
  _set(cfg, field, value)
  with pytest.raises(ValueError, match=message):
    loop.check_config(cfg)


def test_every_rule_names_a_field_of_some_config():
  fields = set()
  for module in CONFIGS.values():
    flat = module.get_config().to_dict()
    stack = [("", flat)]
    while stack:
      prefix, d = stack.pop()
      for k, v in d.items():
        fields.add(prefix + k)
        if isinstance(v, dict):
          stack.append((prefix + k + ".", v))
  missing = [path for path, _ in config_rules.RULES if path not in fields]
  assert not missing


@pytest.mark.parametrize("options, message", [
    ({"min_terms": 3, "max_terms": 2}, r"chain_sum: reasoning-gym rejects the options .*"
                                       r"max_terms must be >= min_terms"),
    ({"min_digits": 0}, "chain_sum: reasoning-gym rejects .*min_digits must be positive"),
    ({"max_term": 3}, r"chain_sum: unknown reasoning-gym option\(s\) max_term"),
    ({"seed": 3}, r"unknown reasoning-gym option\(s\) seed \(seed and size are set by the task"),
])
def test_check_config_refuses_reasoning_gym_options_before_any_model_loads(options, message,
                                                                           monkeypatch):
  from experiments.models import pretrained

  def no_load(*args, **kwargs):
    raise AssertionError("check_config must not load a model")

  monkeypatch.setattr(pretrained, "load", no_load)
  cfg = lm_config.get_config()
  cfg.task.kwargs = {"options": options}
  with pytest.raises(ValueError, match=message):
    loop.check_config(cfg)
  cfg.task.kwargs = {"eval_guards": 3}
  with pytest.raises(ValueError, match=r"text task 'chain_sum': unknown option\(s\) eval_guards"):
    loop.check_config(cfg)
  cfg.task.kwargs = {"eval_guard": 0}
  with pytest.raises(ValueError, match="eval_guard must be an int >= 1"):
    loop.check_config(cfg)
  cfg = lm_config.shrink(lm_config.get_config())
  loop.check_config(cfg)  # the quick run's own options pass
