"""Model configuration: one frozen dataclass for Qwen3 / Qwen2 / Llama decoders, read from HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
#: ``ModelConfig.numerics``: the default programs, or batch-invariant ones that make the engine's log-probs
#: equal the trainer's bit for bit (``models.exact``).
NUMERICS = ("default", "exact")
#: The FP8 precision name of a rollout's weights or KV pages (``EngineConfig.weight_dtype`` / ``kv_dtype``).
FP8 = "fp8"
#: How FP8 weights multiply (``EngineConfig.fp8_matmul``; ``models.quantization.fp8_matmul_is_native``).
FP8_MATMULS = ("auto", "native", "reference")
#: ``ModelConfig.exact_kernels``: what exact numerics compute with (``models.exact_kernels.resolve``):
#: ``"auto"`` (the Pallas Triton kernels on CUDA and ROCm GPUs, XLA elsewhere) or one forced.
EXACT_KERNELS = ("auto", "xla", "pallas_triton")
# none: keep every activation; save_projections: keep the q/k/v/o and MLP projections' outputs, recompute
# norms, RoPE, attention and activations; save_attention: keep the attention context only; full: keep each
# layer's input only. dots / dots_no_batch: JAX's checkpoint_dots policies.
#: The rematerialisation policies (``ModelConfig.remat_policy``; the comment above says what each keeps).
REMAT_POLICIES = ("none", "save_projections", "save_attention", "full", "dots", "dots_no_batch")
#: The attention implementations: one vocabulary for training (``models.attention.attention`` over packed
#: rows, ``ModelConfig.attention``) and decoding (the engine's paged KV cache, ``EngineConfig.attention``).
#: ``models.attention`` describes each and resolves ``"auto"`` (``resolve_attention``).
ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "blockwise", "tokamax", "pallas_triton", "jax_pallas_mha")
#: What decoding offers: the portable blockwise online softmax over the KV pages, and JAX's Pallas
#: paged-attention kernel (the other kernels attend packed training rows).
DECODE_ATTENTION_IMPLEMENTATIONS = ("auto", "blockwise", "pallas_triton")
#: Old names, each the same implementation under its name in the vocabulary: training's ``"xla"`` (the dense
#: reference) and the engine's ``"jnp"`` (its blockwise online softmax over pages), ``"pallas_gpu"`` and
#: ``"pallas_interpret"`` (its Pallas kernel, which, like every Pallas kernel here, runs in Pallas'
#: interpreter off GPUs: ``models.platform.pallas_interpreted``).
ATTENTION_ALIASES = {
    "xla": "dense", "jnp": "blockwise", "pallas_gpu": "pallas_triton", "pallas_interpret": "pallas_triton",
}  # fmt: skip
ATTENTION_USES = {"training": ATTENTION_IMPLEMENTATIONS, "decoding": DECODE_ATTENTION_IMPLEMENTATIONS}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def attention_name(name: str, use: str = "training") -> str:
    """``name``'s implementation in the vocabulary (:data:`ATTENTION_IMPLEMENTATIONS`; an old name of
    :data:`ATTENTION_ALIASES` becomes its new one); a ValueError naming what ``use`` (``"training"`` or
    ``"decoding"``) accepts."""
    if use not in ATTENTION_USES:
        raise ValueError(f"attention use {use!r}; expected one of {tuple(ATTENTION_USES)}")
    accepted = ATTENTION_USES[use]
    canonical = ATTENTION_ALIASES.get(name, name) if isinstance(name, str) else name
    if canonical not in accepted:
        old = sorted(old for old, new in ATTENTION_ALIASES.items() if new in accepted)
        raise ValueError(
            f"attention={name!r} for {use}: expected one of {accepted} (or an old name: {', '.join(old)})"
        )
    return canonical


def check_fp8_weight_fields(fields, prefix: str = "") -> None:
    """Raise ValueError naming the first of ``fields``' ``weight_dtype``, ``quantize_head``, ``weight_block``
    and ``fp8_matmul`` (an ``EngineConfig`` or a :class:`RolloutPrecision`) with a value no engine takes;
    ``prefix`` starts each field's name in the message."""
    if fields.weight_dtype not in (None, FP8):
        raise ValueError(f"{prefix}weight_dtype={fields.weight_dtype!r}: expected None (the compute dtype) "
                         "or 'fp8'")
    if fields.quantize_head and fields.weight_dtype != FP8:
        raise ValueError(f"{prefix}quantize_head=True needs weight_dtype='fp8'")
    block = fields.weight_block
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"{prefix}weight_block must be a positive int, got {block!r}")
    if fields.fp8_matmul not in FP8_MATMULS:
        raise ValueError(f"{prefix}fp8_matmul={fields.fp8_matmul!r}; expected one of {FP8_MATMULS}")


@dataclasses.dataclass(frozen=True)
class RolloutPrecision:
    """The precision an exact model's rollout engine samples in (``EngineConfig``'s fields of the same names),
    which the trainer's exact forward computes through (``ModelConfig.rollout_precision``): with FP8 weights
    it multiplies by the same quantized weights, with FP8 or other KV pages it attends to keys and values
    rounded as the pages store them; the gradient passes straight through to the trainer's weights and
    activations (``models.quantization``, docs/exact_numerics.md). The default: the compute dtype.

    Attributes:
      weight_dtype: None (the compute dtype) or ``"fp8"``: the linear layers in 128 x 128-block FP8.
      weight_block: the FP8 weight block edge.
      quantize_head: the output head in FP8 too.
      fp8_matmul: ``"auto"``, ``"native"`` or ``"reference"``, as ``EngineConfig.fp8_matmul``.
      kv_dtype: None (the compute dtype), ``"fp8"`` or a float dtype name: the KV pages' dtype.
    """

    weight_dtype: str | None = None
    weight_block: int = 128
    quantize_head: bool = False
    fp8_matmul: str = "auto"
    kv_dtype: str | None = None

    def __post_init__(self):
        check_fp8_weight_fields(self, prefix="rollout_precision.")
        if self.kv_dtype not in (None, FP8, *SUPPORTED_DTYPES):
            raise ValueError(f"rollout_precision.kv_dtype={self.kv_dtype!r}: expected None, 'fp8' or one of "
                             f"{SUPPORTED_DTYPES}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a decoder-only transformer; hashable, so it can be a ``jax.jit`` static argument.

    ``rope_scaling`` is ``None`` (plain RoPE) or a sorted tuple of ``(key, value)`` items of a ``llama3``
    scaling dict. ``param_dtype`` is the dtype weights are stored in (float32 master weights by default),
    ``compute_dtype`` the dtype matmuls run in (``"bfloat16"`` for mixed precision); softmax, norms and logits
    are always float32. ``attention`` picks the training attention's implementation (a name of
    :data:`ATTENTION_IMPLEMENTATIONS`, an old name stored as its new one; ``models.attention``: ``"auto"`` =
    the first GPU kernel that passes its on-device check, the blockwise XLA one elsewhere),
    ``attention_block_size`` the blockwise one's block. ``mlp_chunk_size`` (0: off) runs the MLP over chunks
    of that many tokens, each rematerialised, when it divides the sequence: long-sequence training then holds
    the MLP's ``[tokens, intermediate]`` activations for one chunk at a time. Change options with
    ``dataclasses.replace``. ``numerics``: ``"default"``, or ``"exact"`` (``models.exact``: the engine's
    and the trainer's forward and log-probs agree bit for bit, at some cost in speed); ``exact_kernels``:
    what exact numerics compute with (:data:`EXACT_KERNELS`, ``models.exact_kernels``);
    ``rollout_precision`` (exact numerics only): the precision of the engine that samples for it
    (:class:`RolloutPrecision`: FP8 weights or KV pages), which the trainer's exact forward then computes
    through too.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool | None = None  # None: the model type's own choice (Qwen3 only)
    qkv_bias: bool | None = None  # None: the model type's own choice (Qwen2 only)
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scan_layers: bool = True
    remat_policy: str = "none"
    attention: str = "auto"
    attention_block_size: int = 512
    mlp_chunk_size: int = 0
    numerics: str = "default"
    exact_kernels: str = "auto"
    rollout_precision: RolloutPrecision = RolloutPrecision()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        # Each HF architecture fixes these; a mismatch could not be saved as a loadable checkpoint.
        for name, own_choice in (
            ("qk_norm", self.model_type == "qwen3"),
            ("qkv_bias", self.model_type == "qwen2"),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, own_choice)
            elif getattr(self, name) != own_choice:
                raise ValueError(
                    f"{name}={getattr(self, name)} does not match model_type={self.model_type!r}"
                )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {SUPPORTED_DTYPES}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r}; expected one of {REMAT_POLICIES}")
        object.__setattr__(self, "attention", attention_name(self.attention, "training"))
        if not isinstance(self.attention_block_size, int) or self.attention_block_size <= 0 \
                or self.attention_block_size % 8:
            raise ValueError(
                f"attention_block_size must be a positive multiple of 8, got {self.attention_block_size!r}"
            )
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics={self.numerics!r}; expected one of {NUMERICS}")
        if self.exact_kernels not in EXACT_KERNELS:
            raise ValueError(f"exact_kernels={self.exact_kernels!r}; expected one of {EXACT_KERNELS}")
        if not isinstance(self.rollout_precision, RolloutPrecision):
            raise ValueError(f"rollout_precision must be a RolloutPrecision, got {self.rollout_precision!r}")
        if self.rollout_precision != RolloutPrecision() and self.numerics != "exact":
            raise ValueError(f"rollout_precision={self.rollout_precision} is for numerics='exact' (the "
                             "trainer computing through the rollout's precision); the default numerics take "
                             "none")
        if not isinstance(self.mlp_chunk_size, int) or self.mlp_chunk_size < 0:
            raise ValueError(f"mlp_chunk_size must be an int >= 0, got {self.mlp_chunk_size!r}")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            missing = [key for key in _LLAMA3_ROPE_KEYS if key not in scaling]
            if scaling.get("rope_type") != "llama3" or missing:
                raise ValueError(
                    f"rope_scaling={scaling!r} is not supported: only rope_type 'llama3' with keys "
                    f"{_LLAMA3_ROPE_KEYS} (missing {missing})"
                )

    @property
    def num_params(self) -> int:
        """Total number of parameters (the tied embedding counted once)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attention += 2 * self.head_dim
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + self.hidden_size


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling items) from either the legacy (``rope_theta``/``rope_scaling``) or the
    transformers-5 (``rope_parameters``) layout of a HF config."""
    params = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling")
    if legacy_scaling:
        params.update(legacy_scaling)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported (only default and 'llama3')")
    return theta, tuple(
        sorted({"rope_type": "llama3", **{k: params[k] for k in _LLAMA3_ROPE_KEYS if k in params}}.items())
    )


def config_from_hf(source, **overrides) -> ModelConfig:
    """Build a :class:`ModelConfig` from a HF config.

    Args:
      source: a path to ``config.json`` or to the checkpoint directory holding it, a ``dict`` with its
        contents, or a ``transformers.PretrainedConfig``.
      **overrides: ModelConfig fields to set (e.g. ``compute_dtype="bfloat16"``, ``scan_layers=False``).

    Raises:
      ValueError naming the field when the config describes something this decoder does not implement
      (unknown ``model_type``, a non-SiLU activation, sliding-window attention, output-projection bias, ...).
    """
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    elif isinstance(source, Mapping):
        hf = dict(source)
    elif hasattr(source, "to_dict"):
        hf = source.to_dict()
    else:
        raise TypeError(f"config_from_hf expects a path, a dict or a transformers config, got {type(source)}")

    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config field model_type={model_type!r} is not supported; expected one of "
            f"{SUPPORTED_MODEL_TYPES}"
        )
    unsupported = [
        ("hidden_act", hf.get("hidden_act", "silu") != "silu", "only 'silu' is implemented"),
        (
            "use_sliding_window",
            bool(hf.get("use_sliding_window")),
            "sliding-window attention is not implemented",
        ),
        ("mlp_bias", bool(hf.get("mlp_bias")), "MLP biases are not implemented"),
        # Llama/Qwen3 ``attention_bias`` also adds an output-projection bias, which this decoder lacks.
        (
            "attention_bias",
            model_type != "qwen2" and bool(hf.get("attention_bias")),
            "attention biases are implemented for qwen2 only (q/k/v)",
        ),
    ]
    for field, is_bad, why in unsupported:
        if is_bad:
            raise ValueError(f"config field {field}={hf.get(field)!r} is not supported: {why}")

    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
    theta, scaling = _rope_from_hf(hf)
    fields = dict(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict (legacy ``rope_theta``/``rope_scaling`` keys, read by transformers 4 and 5
    and vLLM) describing ``config``; ``dtype``: the stored weight dtype (default ``config.param_dtype``)."""
    hf = {
        "architectures": [_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.qkv_bias,
        "torch_dtype": dtype or config.param_dtype,
        "use_cache": True,
    }
    if config.model_type == "qwen2":
        hf["use_sliding_window"] = False
    if config.bos_token_id is not None:
        hf["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        hf["eos_token_id"] = (
            config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else list(config.eos_token_ids)
        )
    return hf
