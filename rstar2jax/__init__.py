"""rstar2jax: agentic reasoning RL (rStar2-Agent, GRPO-RoC) in JAX.

Layers point one way: ``algo`` and ``models`` <- ``engine`` <- ``reward`` <- ``data`` <- ``agent`` <-
``eval`` <- ``config`` <- ``schedules`` and ``policy`` <- ``train`` <- ``serve`` <- ``experiments``. Import
the subpackage you need, e.g. ``from rstar2jax import algo``.
"""

__version__ = "0.1.0"

# ``from rstar2jax import *`` must not bind ``eval`` (it would shadow the builtin); import it by name.
__all__ = ["agent", "algo", "config", "data", "engine", "models", "policy", "reward", "schedules", "train"]
