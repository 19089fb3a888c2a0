"""The engine's settings: :class:`EngineConfig` (shapes and policies of one engine), :class:`SamplingParams`
(how one session samples) and :func:`page_rounded` (a length rounded up to whole KV pages)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rstar2jax.models.config import FP8, RolloutPrecision, attention_name, check_fp8_weight_fields

#: Attention implementations that read FP8 KV pages (``kv_dtype="fp8"``); "pallas_triton" only where the
#: kernel compiles for float8 pages (``paged_attention`` checks on the device).
FP8_KV_ATTENTION = ("auto", "blockwise", "pallas_triton")
DEFAULT_PAGE_SIZE = 16


def _is_float_dtype(name) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(name), jnp.floating)
    except TypeError:
        return False


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


def page_rounded(num_tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """``num_tokens`` rounded up to a whole number of KV pages (an engine's ``max_len`` must be one)."""
    return pages_for(num_tokens, page_size) * page_size


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a session samples: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and policies of an engine. The engine compiles one device program per token bucket (plus one
    that builds its state), whatever the slot count; a distinct value of a shape field compiles its own.

    Attributes:
      num_slots: sequences held side by side (running, paused on a tool, or being prefilled).
      max_len: the longest sequence a slot may hold: a session's prompt + ``max_tokens`` must fit. Sets the
        width of the page table only; KV memory is ``num_pages``. A whole number of pages
        (:func:`page_rounded`).
      decode_chunk: device iterations per step: a step that prefills nothing decodes up to this many tokens
        per running session in one on-device loop before the host sees them.
      token_buckets: token counts a step is padded to (each one program): a step feeds the decode token of
        every running session plus prefill chunks (prompts, tool outputs) up to the largest bucket, so a long
        prompt is prefilled in chunks side by side with the running decodes. Small buckets keep a step of a
        few sessions cheap (a step costs every row it has on a CPU). The largest must be at least
        ``prefill_tile`` and is raised to cover ``num_slots``.
      prefill_tile: query tokens per attention tile of a prefill chunk: a run of tokens of one sequence is
        attended in tiles of this many consecutive tokens (each tile reads its sequence's pages once), a step
        of T tokens has ``T // prefill_tile`` tiles; runs of at most ``prefill_tile // 2`` tokens are attended
        as single queries instead.
      return_on_stop: end a step's decode loop as soon as some session's segment ends (EOS, a stop sequence
        such as a tool-call end tag, its budget or segment limit), so its coroutine resumes at once.
      page_size: tokens per KV page; must divide ``max_len``.
      num_pages: pages in the pool (page 0, the null page, included); None: enough for every slot at
        ``max_len`` (``num_slots * max_len // page_size + 1``). Admission counts these.
      attention: the decode attention, in the training's vocabulary (``models.attention``): ``"auto"`` (the
        Pallas kernel for decode rows on CUDA GPUs, ``blockwise`` elsewhere), ``"blockwise"`` (the portable
        online softmax over pages) or ``"pallas_triton"`` (JAX's Pallas paged-attention kernel, in Pallas'
        interpreter off GPUs: tests). The old names ``"jnp"``, ``"pallas_gpu"`` and ``"pallas_interpret"``
        are accepted and stored as their new ones.
      attention_block: tokens per block of the ``blockwise`` attention's online softmax (a multiple of
        ``page_size``).
      prefix_sharing: prefix cache: whole pages of a prompt prefix already in the pool (another group's
        system prompt, a chat's earlier turns, a finished sequence's tokens) are attached instead of
        prefilled; pages no sequence holds stay cached until the pool needs them (least recently used first).
      poison_freed_pages: fill pages with NaN when they are freed, so that a stale read shows (tests).
      max_stops, max_stop_len: how many stop sequences a segment may have, and their longest length.
      eos_token_ids: tokens that finish a session; None: the model config's.
      kv_dtype: dtype of the KV pages: None (the model's compute dtype), a float dtype name, or ``"fp8"``:
        float8_e4m3fn keys and values with a power-of-two scale per head for each token slot of a page
        (``paged_attention``'s docstring: the choice and its error bound); a pool of fixed bytes then holds
        ``2 Dh / (Dh + 2)`` times the tokens of a bfloat16 one (1.97x at ``head_dim`` 128):
        :func:`~rstar2jax.engine.paged_attention.pages_for_bytes` sizes it.
      weight_dtype: the engine's copy of the weights: None (the model's compute dtype) or ``"fp8"``: the
        linear layers' weights float8_e4m3fn in ``weight_block`` x ``weight_block`` blocks with float32 scales
        (``models.quantization``), made at construction and at every weight update
        (``programs.engine_params``); the embedding and the output head stay in the compute dtype.
      quantize_head: with ``weight_dtype="fp8"``, the output head in FP8 too (tied embeddings: an FP8 copy of
        the embedding's transpose; the lookup keeps the embedding).
      weight_block: the FP8 weight block edge; must divide both sides of every quantized weight's matrix.
      fp8_matmul: ``"auto"`` (float8 matmuls where ``models.platform.fp8_matmul_native()`` finds them:
        H100/H200, MI300; elsewhere dequantize, then multiply), ``"native"`` or ``"reference"``.
      seed: mixed into the seed of every session opened without one.
      unstacked_decode: how the layers run. False: the layer-stacked weights under one ``lax.scan`` (one
        compiled layer body: compile time does not grow with depth). True: per-layer copies of the weights in
        the compute dtype, made once when the engine is built, layers unrolled: no per-step slicing of the
        stacked weights, at the cost of a second copy of the layer weights and compile time growing with
        depth. XLA:CPU copies every weight slice the scan feeds to a dot, every layer of every step: on the
        Qwen3-0.6B shape (28 layers, float32, this 2-core CPU at load ~4) batch-1 decode ran at 6.2 tokens/s
        scanned and 10.6 unrolled, while compiling the five step programs took 12 s scanned and 39 s unrolled
        (GPUs slice without copying). None (default): unrolled for models of at most
        ``programs.UNROLL_MAX_LAYERS`` (4) layers on CPU, where compiling them stays cheap; else scanned.
    """

    num_slots: int = 32
    max_len: int = 4096
    decode_chunk: int = 16
    token_buckets: tuple[int, ...] = (1, 4, 16, 64, 256)
    prefill_tile: int = 16
    max_stops: int = 4
    max_stop_len: int = 8
    eos_token_ids: tuple[int, ...] | None = None
    seed: int = 0
    unstacked_decode: bool | None = None
    return_on_stop: bool = True
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None
    attention: str = "auto"
    attention_block: int = 256
    prefix_sharing: bool = True
    poison_freed_pages: bool = False
    kv_dtype: str | None = None
    weight_dtype: str | None = None
    quantize_head: bool = False
    weight_block: int = 128
    fp8_matmul: str = "auto"

    def __post_init__(self):
        for name in ("num_slots", "max_len", "decode_chunk", "max_stops", "max_stop_len", "page_size",
                     "attention_block", "prefill_tile"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_len % self.page_size:
            raise ValueError(f"page_size={self.page_size} must divide max_len={self.max_len} "
                             f"(page_rounded({self.max_len}, {self.page_size}) = "
                             f"{page_rounded(self.max_len, self.page_size)})")
        if self.attention_block % self.page_size:
            raise ValueError(f"attention_block={self.attention_block} must be a multiple of "
                             f"page_size={self.page_size}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), "
                             f"got {self.num_pages!r}")
        object.__setattr__(self, "attention", attention_name(self.attention, "decoding"))
        self._check_precision()  # after the attention's old name became its new one
        buckets = self.token_buckets
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            raise ValueError(f"token_buckets must be positive ints, got {buckets}")
        if max(buckets) < self.prefill_tile:
            raise ValueError(f"the largest token bucket ({max(buckets)}) must hold a prefill tile "
                             f"(prefill_tile={self.prefill_tile})")
        buckets = set(buckets)
        if max(buckets) < self.num_slots:  # every running session must fit one step
            buckets.add(self.num_slots)
        object.__setattr__(self, "token_buckets", tuple(sorted(buckets)))

    def _check_precision(self) -> None:
        """Raise ValueError naming a precision field with a value no engine takes."""
        kv = self.kv_dtype
        if kv is not None and kv != FP8 and not _is_float_dtype(kv):
            raise ValueError(f"kv_dtype={kv!r}: expected None, 'fp8' or a float dtype name")
        check_fp8_weight_fields(self)
        if kv == FP8 and self.attention not in FP8_KV_ATTENTION:
            raise ValueError(f"attention={self.attention!r} cannot read FP8 KV pages (kv_dtype='fp8'); "
                             f"use one of {FP8_KV_ATTENTION}")

    @property
    def rollout_precision(self) -> RolloutPrecision:
        """This engine's precision fields as an exact model's ``ModelConfig.rollout_precision`` (the
        precision the trainer's exact forward then computes through)."""
        return RolloutPrecision(weight_dtype=self.weight_dtype, weight_block=self.weight_block,
                                quantize_head=self.quantize_head, fp8_matmul=self.fp8_matmul,
                                kv_dtype=self.kv_dtype)

    @property
    def cache_dtype(self) -> str | None:
        """The older name of ``kv_dtype``."""
        return self.kv_dtype

    @property
    def pool_pages(self) -> int:
        """Pages in the pool, the null page included."""
        if self.num_pages is not None:
            return self.num_pages
        return self.num_slots * (self.max_len // self.page_size) + 1

    @property
    def max_pages(self) -> int:
        """Width of a page-table row."""
        return self.max_len // self.page_size

    @property
    def max_step_tokens(self) -> int:
        """Tokens one step can feed (the largest bucket)."""
        return self.token_buckets[-1]
