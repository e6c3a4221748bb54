"""Rollout groups as prefix trees, and segment reductions over their nodes."""

from trees.node_values import (node_count, node_max, node_mean, node_min, node_std, node_sum,
                               per_group, prefix_values, to_tokens)
from trees.prefix_tree import PrefixTree, build, build_from_keys
from trees.siblings import SiblingStats, sibling_stats
from trees.explicit import from_forks
from trees.children import (ChildStats, LevelStats, child_mean_values, child_stats, end_nodes,
                            level_stats, level_to_tokens, tree_values)
from trees.segments import segment_fill, segment_start
from trees.render import render_text, to_dot
from trees.step_graph import (StepGraph, build_group, build_step_graph, discounted_turn_returns,
                              gather_nodes, map_groups, unique_ids)
