"""Generation engine: one state pytree, jitted append/decode/release, async host scheduler."""
