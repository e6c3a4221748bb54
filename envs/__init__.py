"""JAX-native tasks with verifiable rewards: `envs.get(name, **kwargs) -> Task`."""

from envs.addition import Addition
from envs.base import EOS, PAD, Task
from envs.countdown import Countdown
from envs.registry import get, names
from envs.token_tree import TokenTree
