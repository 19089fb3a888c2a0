"""Multi-turn tool rollouts, tool-call parsing, the sandbox client."""
