"""Qwen3 / Qwen2 / Llama decoder, HF checkpoint load/save, KV cache, logical sharding."""
