"""rstar2jax: agentic reasoning RL (rStar2-Agent, GRPO-RoC) in JAX.

Layers point one way: ``algo`` and ``models`` <- ``engine`` <- ``agent`` (+ ``reward``)
<- ``train`` <- ``experiments``. Import the subpackage you need, e.g.
``from rstar2jax import algo``.
"""

__version__ = "0.1.0"
