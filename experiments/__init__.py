"""absl launchers, ml_collections configs and benchmarks."""
