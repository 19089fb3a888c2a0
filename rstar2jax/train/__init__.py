"""SFT and RL steps, optimizer, mesh, orbax checkpoints, metrics."""
