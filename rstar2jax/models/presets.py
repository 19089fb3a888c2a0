"""Named model shapes: the real Qwen3 0.6B-14B architectures (their official HF ``config.json`` files ship in
``hf_configs/``, see its README for provenance) and ``tiny``, the small Qwen3 used by tests, benches and smoke
runs. No weights: a preset is a ``ModelConfig`` for random initialisation, dry runs and benchmarks.

    models.preset("qwen3-14b", compute_dtype="bfloat16")   # the paper's model shape
    models.preset("tiny", vocab_size=151936)               # tiny, with the real Qwen3 vocabulary

In a training config: ``config.model.preset = "qwen3-14b"``.
"""

from __future__ import annotations

import dataclasses
import pathlib

from rstar2jax.models.config import ModelConfig, config_from_hf

#: Folder of the bundled official Qwen3 ``config.json`` files (``<preset name>.json``).
HF_CONFIGS_DIR = pathlib.Path(__file__).resolve().parent / "hf_configs"
#: Folder of the bundled official Qwen3 tokenizer (shared by every Qwen3 size; Apache-2.0, see its README).
QWEN3_TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent / "tokenizers" / "qwen3"

#: The tiny Qwen3: 2 layers, width 64, 4 query / 2 KV heads of 16, a 256-token vocabulary (about 0.1M
#: parameters). Tests and benches that need another vocabulary or width override fields.
TINY = ModelConfig(
    model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip

#: Preset names: ``tiny`` and the bundled Qwen3 architectures.
PRESETS = ("tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b")


def preset(name: str, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of preset ``name`` (one of ``PRESETS``), with ``overrides`` (ModelConfig fields,
    e.g. ``num_layers=4``, ``compute_dtype="bfloat16"``) applied.

    Raises:
      ValueError naming the preset and the known names when ``name`` is unknown.
    """
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; expected one of {PRESETS}")
    if name == "tiny":
        return dataclasses.replace(TINY, **overrides)
    return config_from_hf(HF_CONFIGS_DIR / f"{name}.json", **overrides)
