"""JAX-native tasks with verifiable rewards: `envs.get(name, **kwargs) -> Task`; multi-turn
environments: `envs.get_env(name, **kwargs) -> MultiTurnEnv`."""

from envs.addition import Addition
from envs.base import EOS, PAD, Task
from envs.countdown import Countdown
from envs.exact_mdp import ExactMDP
from envs.household import Household
from envs.household_long import HouseholdLong
from envs.multiturn import MultiTurnEnv
from envs.registry import env_names, get, get_env, names
from envs.sokoban import Sokoban
from envs.token_tree import TokenTree
from envs.webshop import WebShop
