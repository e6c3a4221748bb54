"""Tests for experiments/credit_quality.py: the metrics, `measure`, and the CLI end to end."""

import json
import math

import numpy as np
import pytest

import envs
from experiments import credit_quality as cq

# [2, 5] true advantages; the last token of each row is masked out (garbage there).
TRUE = np.array([[2.0, -1.0, 0.0, 1.0, -3.0],
                 [0.5, 0.0, -0.5, 0.0, 7.0]])
MASK = np.array([[True] * 4 + [False]] * 2)
DECISIVE = np.array([True, True, True, False, True])  # [L], broadcast over rows


def test_metrics_proportional_flipped_zero():
  n_valid = 8
  zero_mse = float(np.mean(TRUE[MASK] ** 2))
  decisive_tokens = 4  # decisive, valid, A* != 0: (0,0) (0,1) (1,0) (1,2)
  prop = cq.credit_metrics(3.0 * TRUE, TRUE, MASK, DECISIVE)
  assert prop["tokens"] == n_valid and prop["decisive_tokens"] == decisive_tokens
  np.testing.assert_allclose([prop["corr"], prop["alpha"], prop["mse"], prop["sign"]],
                             [1.0, 1 / 3, 0.0, 1.0], atol=1e-12)
  flip = cq.credit_metrics(-TRUE, TRUE, MASK, DECISIVE)
  np.testing.assert_allclose([flip["corr"], flip["alpha"], flip["mse"], flip["sign"]],
                             [-1.0, -1.0, 0.0, 0.0], atol=1e-12)
  zero = cq.credit_metrics(np.zeros_like(TRUE), TRUE, MASK, DECISIVE)
  assert zero["alpha"] == 0.0 and zero["sign"] == 0.0 and zero["corr"] == 0.0
  assert zero["mse"] == pytest.approx(zero_mse)


def test_metrics_hand_computed():
  true = TRUE[:1]
  adv = np.array([[1.0, 0.0, 1.0, 1.0, 100.0]])
  m = cq.credit_metrics(adv, true, MASK[:1], DECISIVE)
  # a − ā = [.25, −.75, .25, .25], A* − Ā* = [1.5, −1.5, −.5, .5]: 1.5 / sqrt(.75 · 5).
  assert m["corr"] == pytest.approx(1.5 / math.sqrt(3.75))
  assert m["alpha"] == pytest.approx(1.0)  # <a, A*> = 3 = <a, a>
  assert m["mse"] == pytest.approx(0.75)  # (1 − 2)², (0 + 1)², (1 − 0)², 0
  assert m["sign"] == pytest.approx(0.5)  # position 0 agrees, 1 has a = 0; 2 has A* = 0
  assert m["tokens"] == 4 and m["decisive_tokens"] == 2
  bad = cq.credit_metrics(np.where(MASK, np.nan, 0.0), TRUE, MASK, DECISIVE)
  assert all(math.isnan(bad[k]) for k in ("corr", "alpha", "mse", "sign"))


def test_measure_tiny_tempo_beats_grpo():
  # Checked beforehand: tempo's corr exceeds grpo's by >= 0.025 on each of seeds 0-29 (B=32, 64).
  task = envs.get("token_tree")
  out = cq.measure(task, ["grpo", "tempo"], [4], 64, seed=0)
  assert out["skipped"] == {}
  for name in ("grpo", "tempo"):
    m = out["results"][name][4]
    assert all(math.isfinite(m[k]) for k in ("corr", "alpha", "mse", "sign"))
    assert m["tokens"] == 64 * 4 * task.response_len
  facts = out["groups"][4]
  assert 0 < facts["reward_variance_frac"] <= 1 and facts["num_prompts"] == 64
  assert out["results"]["tempo"][4]["corr"] > out["results"]["grpo"][4]["corr"] + 0.01


def test_measure_skips_missing_fields_per_group_size(monkeypatch):
  def only_g4(rollouts):
    if rollouts.group_size != 4:
      raise ValueError("only_g4 needs G = 4.\nmore detail")
    centred = rollouts.rewards - rollouts.rewards.mean(-1, keepdims=True)
    return centred[..., None] * rollouts.mask  # Dr. GRPO

  real = cq._jitted
  monkeypatch.setattr(cq, "_jitted", lambda name: only_g4 if name == "only_g4" else real(name))
  out = cq.measure(envs.get("token_tree"), ["dr_grpo", "gae", "only_g4"], [2, 4], 64, seed=0,
                   max_responses=None)
  assert out["skipped"] == {"gae": "ValueError: gae needs rollouts.values (critic values per "
                                   "token)."}
  assert out["skipped_at"] == {"only_g4": {2: "ValueError: only_g4 needs G = 4."}}
  assert math.isnan(out["results"]["only_g4"][2]["corr"])
  assert out["results"]["only_g4"][4] == pytest.approx(out["results"]["dr_grpo"][4], abs=1e-6)


def test_prompts_for_caps_responses():
  assert cq.prompts_for(4, 512, 8192) == 512
  assert cq.prompts_for(64, 512, 8192) == 128
  assert cq.prompts_for(64, 512, None) == 512


def test_main_end_to_end(tmp_path, capsys):
  report = cq.main(["--group_sizes", "2,4", "--num_prompts", "64", "--estimators",
                    "grpo,tempo,gae", "--seeds", "2", "--workdir", str(tmp_path)])
  text = capsys.readouterr().out
  assert "tempo" in text and "skipped gae" in text and "KL terms are 0" in text
  assert (tmp_path / "credit_quality.png").stat().st_size > 0

  def no_nan(name):
    raise ValueError(f"non-standard JSON constant {name}")

  saved = json.loads((tmp_path / "credit_quality.json").read_text(), parse_constant=no_nan)
  assert set(saved["summary"]) == {"grpo", "tempo"} and "gae" in saved["skipped"]
  assert saved["seeds"] == [0, 1] and len(saved["runs"]) == 2
  corr_mean, corr_std = saved["summary"]["tempo"]["4"]["corr"]
  assert -1 <= corr_mean <= 1 and corr_std >= 0
  assert report["group_sizes"] == [2, 4]


def test_estimators_take_hyperparameters():
  """'name[key=value]' scores the estimator with those hyperparameters (here treerl's two
  variants, which differ on i.i.d. prefix trees); bad ones are refused by name."""
  out = cq.measure(envs.get("token_tree"), ["treerl", "treerl[variant='code']"], [4], 64,
                   seed=0, max_responses=None)
  paper, code = (out["results"][n][4]["corr"] for n in ("treerl", "treerl[variant='code']"))
  assert math.isfinite(code) and paper != code
  assert cq._split("treerl[variant='code',sqrt_leaves=False]") == (
      "treerl", (("sqrt_leaves", False), ("variant", "code")))
  with pytest.raises(ValueError, match="name\\[key=value"):
    cq._split("treerl[variant='code'")
  with pytest.raises(ValueError, match="no hyperparameter color"):
    cq.main(["--estimators", "treerl[color=1]", "--group_sizes", "4"])
