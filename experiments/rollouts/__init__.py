"""Rollouts: the token samplers (i.i.d. and trees with prefix KV reuse), the multi-turn
sampler, and the loop's text and agent problems."""
