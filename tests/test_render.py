"""trees.render and the example script: what a notebook user sees."""

import numpy as np

import credit
import trees
from experiments import show_tree


def test_render_text_shows_branches_values_and_responses():
  tokens, mask, rewards, detok = show_tree.example_group()
  tree = trees.build(tokens, mask)
  adv = credit.get("tempo")(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards))
  text = trees.render_text(tree, rewards, advantages=adv, detokenize=detok)
  lines = text.splitlines()
  assert lines[0] == "root  n=8  V=0.375"
  assert "*[4]  n=6  V=0.500  TD=+0.125" in lines
  assert "  *[7$]  n=3  V=1.000  TD=+0.500" in lines
  assert sum("-> response" in line for line in lines) == 8


def test_render_selects_a_group_from_a_batch_and_exports_dot():
  tokens = np.array([[[1, 2], [1, 3]], [[4, 4], [4, 4]]], np.int32)
  mask = np.ones((2, 2, 2), bool)
  rewards = np.array([[1.0, 0.0], [0.5, 0.5]], np.float32)
  tree = trees.build(tokens, mask)
  text = trees.render_text(tree, rewards, index=1)
  assert "[4 4]  n=2  V=0.500" in text
  dot = trees.to_dot(tree, rewards, index=0)
  assert dot.startswith("digraph") and dot.count("->") == 3


def test_show_tree_script_runs(capsys):
  show_tree.main([])
  out = capsys.readouterr().out
  assert "root  n=8" in out and "Per-token advantages (tempo | grpo)" in out
