"""GRPO-RoC algorithm core: group advantages, RoC selection, penalties, policy losses (pure jnp)."""
