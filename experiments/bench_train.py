"""Benchmark: ``rl_step`` (GRPO-RoC loss, gradient, clip, AdamW) tokens/s against the same update written in
PyTorch on transformers' Qwen3, same shapes, batch and sequence length, on this CPU.

  python -m experiments.bench_train [--steps=5] [--full_depth]
  python -m experiments.bench_train --memory     # long-context memory and packing (CPU)
  python -m experiments.bench_train --gpu        # Qwen3-1.7B, bf16, 8 x 8192 on one GPU: tokens/s, MFU
  python -m experiments.bench_train --lora       # LoRA against full fine-tuning (issue 35)

Each (framework, shape) runs in its own subprocess, so peak memory (max RSS) is its own. Both sides compute
the same thing per step: forward, token log-probs, clipped surrogate with ε 0.2/0.28 and the token-mean
normaliser, the policy entropy (for logging, no gradient), backward, global-norm clip 1.0, AdamW (lr 1e-6,
wd 0.01), float32 throughout. Shapes: a small Qwen3, and the Qwen3-0.6B layer and vocabulary shape with 4 of
its 28 layers and one row (fp32 weights + AdamW of all 28 need ~10 GiB per process, too much for a shared
24 GiB machine; --full_depth runs them). Prints a table; the last line is one JSON object.

``--memory`` (issue 22): compiled (XLA memory analysis, CPU, nothing allocated) temporary bytes of one full
``rl_step`` (forward, backward, clip, AdamW) for the Qwen3-0.6B shape with 2 layers and its real vocabulary
(151,936), one packed row, float32, remat "full" and the MLP in 512-token chunks: at 2048 tokens and at
8192 (4 trajectories of 2048); against the same step with dense attention (the quadratic baseline) at 8192
and the float32 [8192, V] logits the trainer used to hold. Then ``rl_step`` tokens/s (real tokens) of the
small shape on 8 trajectories (--trajectories) with lengths drawn from 64-2048, packed first-fit decreasing
into 2048-token rows, against the same trajectories padded one per row; and one 2048-token row with
blockwise vs dense attention. JSON keys: temp_gib_8192, temp_ratio_8192_over_2048, packed_tokens_per_s_ratio.

``--lora`` (issue 35): LoRA of rank 16 on all seven projections against full fine-tuning. Bytes of
trainable parameters + their gradients + AdamW state for the Qwen3-0.6B shape (all 28 layers, abstract
shapes); ``rl_step`` tokens/s of the Qwen3-0.6B shape at 4 of its layers, float32, on the same batch
(--lora_rows x --lora_seq_len), both measured in this process one after the other; and the compiled
``rl_step`` peak of ``experiments/configs/paper_qwen3_14b_lora_1gpu.py`` on one device at its 8K stage (the
dry run's compile on abstract shapes: nothing allocated; on the CPU without XLA:CPU's hoisted float32 upcast
of the bfloat16 weights, which no accelerator makes, see ``train.dry_run``; the figure with it is printed
too). JSON keys: lora_state_bytes_ratio, lora_step_tokens_per_s_ratio, lora_14b_train_peak_gib.

``--gpu``: Qwen3-1.7B (28 layers), float32 master weights and AdamW, bfloat16 compute, remat "full",
attention "auto" (``models.attention.auto_choice``), 8 rows x 8192 tokens: tokens/s and MFU (model FLOPs:
6 x parameters x tokens plus causal attention 6 x layers x T^2 x heads x head_dim per row, over the GPU's
dense bf16 peak).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import flags

from experiments import bench_record

_STEPS = flags.DEFINE_integer("steps", 5, "timed steps per run (after one warm-up step)")
_FULL_DEPTH = flags.DEFINE_bool("full_depth", False, "run all 28 layers of the Qwen3-0.6B shape")
_WORKER = flags.DEFINE_string("worker", None, "internal: run one 'framework:shape' measurement")
_MEMORY = flags.DEFINE_bool("memory", False, "long-context memory and packing figures (issue 22)")
_TRAJECTORIES = flags.DEFINE_integer("trajectories", 8, "--memory: trajectories in the packing batch")
_GPU = flags.DEFINE_bool("gpu", False, "Qwen3-1.7B rl_step at 8 x 8192, bf16, on the default GPU")
_GPU_ROWS = flags.DEFINE_integer("gpu_rows", 8, "--gpu: rows per step")
_GPU_SEQ_LEN = flags.DEFINE_integer("gpu_seq_len", 8192, "--gpu: tokens per row")
_LORA = flags.DEFINE_bool("lora", False, "LoRA vs full fine-tuning: state bytes, rl_step tokens/s, 14B peak")
_LORA_ROWS = flags.DEFINE_integer("lora_rows", 4, "--lora: rows of the timed batch")
_LORA_SEQ_LEN = flags.DEFINE_integer("lora_seq_len", 512, "--lora: tokens per row of the timed batch")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The bundled HF config of preset "qwen3-0.6b", read as a file: the PyTorch worker imports no JAX.
QWEN3_06B = os.path.join(REPO, "rstar2jax", "models", "hf_configs", "qwen3-0.6b.json")
SMALL = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
)  # fmt: skip
SHAPES = {"small": (SMALL, 8, 256), "qwen3-0.6b": (None, 1, 256)}  # (HF config fields, batch, seq_len)


def hf_config(shape: str, full_depth: bool) -> dict:
    fields, _, _ = SHAPES[shape]
    if fields is None:
        with open(QWEN3_06B) as f:
            config = json.load(f)
        if not full_depth:
            config["num_hidden_layers"] = 4
        return config
    return {
        "model_type": "qwen3",
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "attention_bias": False,
        **fields,
    }


def synthetic_batch(vocab: int, batch: int, seq_len: int):
    """Full rows (one trajectory each): a 32-token prompt, then response tokens trained on."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    mask = np.zeros((batch, seq_len), np.float32)
    mask[:, 31:] = 1.0
    old_logp = (-rng.random((batch, seq_len)) * 10).astype(np.float32)
    advantages = np.repeat(rng.normal(size=(batch, 1)), seq_len, axis=1).astype(np.float32)
    return tokens, mask, old_logp, advantages


def run_jax(config: dict, batch: int, seq_len: int, steps: int) -> dict:
    import numpy as np

    from rstar2jax import models, train

    model_config = models.config_from_hf(config)
    tokens, mask, old_logp, advantages = synthetic_batch(model_config.vocab_size, batch, seq_len)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len))
    data = train.Batch(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        positions=positions,
        segment_ids=np.ones((batch, seq_len), np.int32),
        loss_mask=mask,
        advantages=advantages,
        sampler_logp=old_logp,
    )
    return rl_step_timing(model_config, data, steps)


def rl_step_timing(model_config, batch, steps: int) -> dict:
    """Compile seconds, median step seconds (after one warm-up step), the last loss and the compiled
    temporaries of the jitted ``rl_step`` on ``batch`` (fresh random parameters and AdamW state)."""
    import jax
    import numpy as np

    from rstar2jax import models, train

    batch = jax.device_put(batch)
    optimizer = train.make_optimizer()
    state = train.init_train_state(models.init_params(model_config, jax.random.PRNGKey(0)), optimizer, 0)
    step = train.make_rl_step(model_config, optimizer)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    times, metrics = timed_steps(compiled, state, batch, steps)
    return {
        "step_s": float(np.median(times)),
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "xla_temp_mib": memory.temp_size_in_bytes / 2**20,
    }


def run_torch(config: dict, batch: int, seq_len: int, steps: int) -> dict:
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).float()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, eps=1e-8)
    tokens, mask, old_logp, advantages = (
        torch.from_numpy(x) for x in synthetic_batch(config["vocab_size"], batch, seq_len)
    )
    tokens = tokens.long()

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            entropy = (entropy * mask).sum() / mask.sum()
        ratio = torch.exp(torch.clamp(logp - old_logp, -20, 20))
        losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.28))
        loss = (losses * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item(), entropy.item()

    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss, _ = step()
        times.append(time.perf_counter() - start)
    return {"step_s": float(np.median(times)), "compile_s": 0.0, "loss": loss, "xla_temp_mib": 0.0}


GIB = 2.0**30


def _packed_batch(lengths, seq_len: int, vocab: int, *, pack: bool, seed: int = 0):
    """An RL batch of trajectories of the given token counts (a 32-token prompt, the rest trained on)."""
    import numpy as np

    from rstar2jax import train
    from rstar2jax.data import packing

    rng = np.random.default_rng(seed)
    sequences = [
        train.TokenSequence(
            tokens=rng.integers(0, vocab, n).tolist(),
            loss_mask=[0] * 32 + [1] * (n - 32),
            logprobs=(-rng.random(n) * 10).tolist(),
            advantage=float(rng.normal()),
        )
        for n in lengths
    ]
    # Exactly the rows needed (build_batch would round them up to a power of two).
    rows = len(packing.first_fit_decreasing([n - 1 for n in lengths], seq_len)) if pack else len(lengths)
    return train.build_batch(sequences, seq_len=seq_len, num_rows=rows, pack=pack, with_rl_fields=True)


def compiled_temp_bytes(model_config, batch) -> int:
    """Temporary bytes of the compiled rl_step (XLA memory analysis on abstract shapes: nothing allocated)."""
    import jax

    from rstar2jax import models, train

    optimizer = train.make_optimizer()
    state = jax.eval_shape(
        lambda: train.init_train_state(models.init_params(model_config, jax.random.PRNGKey(0)), optimizer, 0)
    )
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    compiled = train.make_rl_step(model_config, optimizer).lower(state, abstract).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def time_rl_step(model_config, batch, steps: int) -> float:
    """Median seconds of the jitted rl_step on ``batch`` (after one warm-up step)."""
    return rl_step_timing(model_config, batch, steps)["step_s"]


def timed_steps(step, state, batch, steps: int) -> tuple[list[float], dict]:
    """Seconds of each of ``steps`` calls of ``step(state, batch)`` after one warm-up call (the state is
    threaded through: the step donates it), and the last call's metrics."""
    import jax

    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return times, metrics


def memory_main() -> None:
    import dataclasses

    import numpy as np

    from rstar2jax import models

    long_context = models.preset(
        "qwen3-0.6b",
        num_layers=2,
        remat_policy="full",
        mlp_chunk_size=512,
        attention="blockwise",
        attention_block_size=256,
    )
    print(
        "rl_step compiled temporaries, Qwen3-0.6B shape with 2 layers, vocabulary 151,936, one packed row, "
        "fp32, remat full, MLP in 512-token chunks (XLA memory analysis, CPU)",
        flush=True,
    )
    print(f"{'tokens':>8}{'attention':>12}{'temp GiB':>10}", flush=True)
    temp = {}
    for tokens in (2048, 8192):
        batch = _packed_batch([2049] * (tokens // 2048), tokens, long_context.vocab_size, pack=True)
        assert batch.shape == (1, tokens), batch.shape  # one packed row
        temp[tokens] = compiled_temp_bytes(long_context, batch)
        print(f"{tokens:>8}{'blockwise':>12}{temp[tokens] / GIB:>10.3f}", flush=True)
    dense = compiled_temp_bytes(dataclasses.replace(long_context, attention="dense"), batch)
    print(f"{8192:>8}{'dense':>12}{dense / GIB:>10.3f}", flush=True)
    logits_gib = 8192 * long_context.vocab_size * 4 / GIB
    print(f"(the float32 [8192, V] logits the trainer used to materialise: {logits_gib:.2f} GiB)", flush=True)

    # Packing: the small shape, trajectories of 64-2048 tokens (+1: a trajectory of n tokens fills n - 1
    # positions), packed first-fit decreasing vs padded one per row.
    small = models.config_from_hf(hf_config("small", False))
    lengths = np.random.default_rng(0).integers(64, 2049, _TRAJECTORIES.value) + 1
    real_tokens = int(np.sum(lengths - 1))
    packed = _packed_batch(lengths, 2048, small.vocab_size, pack=True)
    padded = _packed_batch(lengths, 2048, small.vocab_size, pack=False)
    packed_s = time_rl_step(small, packed, _STEPS.value)
    padded_s = time_rl_step(small, padded, _STEPS.value)
    ratio = padded_s / packed_s
    print(
        f"packing, small shape, {len(lengths)} trajectories of 64-2048 tokens ({real_tokens} real tokens): "
        f"packed {packed.shape[0]} rows x 2048: {real_tokens / packed_s:.0f} tokens/s; "
        f"padded {padded.shape[0]} rows x 2048: {real_tokens / padded_s:.0f} tokens/s; ratio {ratio:.2f}",
        flush=True,
    )
    # No regression at 2048 tokens: the small shape, one full row of 2048, blockwise vs dense attention.
    row_2048 = _packed_batch([2049], 2048, small.vocab_size, pack=False)
    blockwise_s = time_rl_step(small, row_2048, _STEPS.value)
    dense_s = time_rl_step(dataclasses.replace(small, attention="dense"), row_2048, _STEPS.value)
    print(
        f"small shape, 1 x 2048 tokens: blockwise attention {2048 / blockwise_s:.0f} tokens/s, dense "
        f"{2048 / dense_s:.0f} tokens/s (ratio {dense_s / blockwise_s:.2f})",
        flush=True,
    )
    print(
        json.dumps(
            {
                "temp_gib_8192": round(temp[8192] / GIB, 3),
                "temp_gib_2048": round(temp[2048] / GIB, 3),
                "temp_ratio_8192_over_2048": round(temp[8192] / temp[2048], 3),
                "dense_attention_temp_gib_8192": round(dense / GIB, 3),
                "float32_logits_gib_8192": round(logits_gib, 3),
                "packed_tokens_per_s_ratio": round(ratio, 3),
                "packed_tokens_per_s": round(real_tokens / packed_s, 1),
                "padded_tokens_per_s": round(real_tokens / padded_s, 1),
                "blockwise_over_dense_tokens_per_s_2048": round(dense_s / blockwise_s, 3),
                "packed_rows": packed.shape[0],
                "padded_rows": padded.shape[0],
                "trajectories": len(lengths),
                "device": "cpu",
                "cores": os.cpu_count(),
                "steps": _STEPS.value,
            }
        )
    )


# Dense bf16 peak FLOP/s by device kind (vendors' datasheets, without sparsity); the first name the device's
# kind contains wins (so "H100 PCIe" before "H100").
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
    "MI355": 2500e12,
    "MI325": 1307e12,
    "MI300X": 1307e12,
    "MI250": 383e12,
}


def peak_bf16_flops(device_kind: str) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None for a kind not in ``PEAK_BF16_FLOPS``."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_kind), None)


def rl_step_flops(config, rows: int, seq_len: int) -> float:
    """Model FLOPs of one training step on ``rows`` full rows of ``seq_len`` tokens: 6 x parameters x tokens
    plus causal attention, 6 x layers x T^2 x heads x head_dim per row (rematerialisation not counted)."""
    attention = 6 * config.num_layers * rows * seq_len**2 * config.num_heads * config.head_dim
    return 6 * config.num_params * rows * seq_len + attention


def gpu_main() -> None:
    import jax

    from rstar2jax import models

    device = jax.devices()[0]
    rows, seq_len = _GPU_ROWS.value, _GPU_SEQ_LEN.value
    config = models.preset("qwen3-1.7b", compute_dtype="bfloat16", remat_policy="full", attention="auto")
    lengths = [seq_len + 1] * rows  # one trajectory per row, every position trained on after the prompt
    batch = _packed_batch(lengths, seq_len, config.vocab_size, pack=False)
    step_s = time_rl_step(config, batch, _STEPS.value)
    tokens = rows * seq_len
    flops = rl_step_flops(config, rows, seq_len)
    peak = peak_bf16_flops(device.device_kind)
    mfu = None if peak is None else flops / step_s / peak
    attention = models.attention.resolve_implementation("auto", config.head_dim, config.compute_dtype)
    print(
        f"Qwen3-1.7B rl_step on {device.device_kind}: {rows} x {seq_len} tokens, bf16 compute, fp32 master "
        f"weights + AdamW, remat full, attention {attention}: "
        f"{step_s:.3f} s/step, {tokens / step_s:.0f} tokens/s, MFU {mfu if mfu is None else f'{mfu:.1%}'}"
    )
    print(
        json.dumps(
            {
                "device": device.device_kind,
                "rows": rows,
                "seq_len": seq_len,
                "step_s": round(step_s, 4),
                "tokens_per_s": round(tokens / step_s, 1),
                "mfu": None if mfu is None else round(mfu, 4),
                "model_tflop_per_step": round(flops / 1e12, 2),
                "steps": _STEPS.value,
            }
        )
    )


def lora_state_bytes(model_config, lora) -> int:
    """Bytes of the trainable parameters, their gradients and the AdamW state (abstract: nothing allocated);
    ``lora`` None: full fine-tuning."""
    import math

    import jax
    import numpy as np

    from rstar2jax import train

    params = jax.eval_shape(lambda: train.trainable_params(model_config, jax.random.PRNGKey(0), lora))
    opt_state = jax.eval_shape(train.make_optimizer().init, params)
    leaves = jax.tree.leaves(params) * 2 + jax.tree.leaves(opt_state)  # params, gradients, moments
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)


def lora_step_seconds(model_config, lora, batch, steps: int) -> float:
    """Median seconds of ``rl_step`` on ``batch``: full fine-tuning (``lora`` None) or the adapters of a
    float32 base."""
    import jax
    import numpy as np

    from rstar2jax import models, train

    optimizer = train.make_optimizer()
    base = models.init_params(model_config, jax.random.PRNGKey(0))
    if lora is None:
        state, step = train.init_train_state(base, optimizer, 0), train.make_rl_step(model_config, optimizer)
    else:
        adapters = models.lora.init_lora(model_config, lora, jax.random.PRNGKey(1))
        state = train.init_train_state(adapters, optimizer, 0)
        jitted = train.make_rl_step(model_config, optimizer, lora=lora)

        def step(state, batch):
            return jitted(state, batch, base)

    times, _ = timed_steps(step, state, jax.device_put(batch), steps)
    return float(np.median(times))


def lora_14b_peak(stand_in: bool) -> tuple[float, list[int]]:
    """(GiB, batch shape): the compiled rl_step peak of the 14B LoRA one-GPU config at its 8K stage (one
    device). ``stand_in`` False: the CPU compiles as for itself (the float32 upcast of the weights
    hoisted)."""
    from experiments.configs import paper_qwen3_14b_lora_1gpu
    from rstar2jax.train import dry_run, parse

    config = paper_qwen3_14b_lora_1gpu.get_config()
    config.stages = config.stages[:1]  # stage 1: 8K responses
    report = dry_run(parse(config, "rl", check_data=False), cpu_stand_in=stand_in)
    return report["peak_estimate_bytes"] / GIB, report["batch_shape"]


def lora_main() -> None:
    import numpy as np

    from rstar2jax import models

    lora = models.LoraConfig(rank=16, alpha=32.0)  # all seven projections
    shape = models.preset("qwen3-0.6b")
    full_bytes, lora_bytes = lora_state_bytes(shape, None), lora_state_bytes(shape, lora)
    timed = models.preset("qwen3-0.6b", num_layers=4)
    rows, seq_len = _LORA_ROWS.value, _LORA_SEQ_LEN.value
    batch = _packed_batch([seq_len + 1] * rows, seq_len, timed.vocab_size, pack=False)
    tokens = float((np.asarray(batch.segment_ids) > 0).sum())
    full_s = lora_step_seconds(timed, None, batch, _STEPS.value)
    lora_s = lora_step_seconds(timed, lora, batch, _STEPS.value)
    peak, batch_shape = lora_14b_peak(stand_in=True)
    raw_peak, _ = lora_14b_peak(stand_in=False)
    print(f"LoRA rank {lora.rank}, alpha {lora.alpha}, all seven projections, vs full fine-tuning "
          f"({os.cpu_count()} CPU cores; median of {_STEPS.value} steps)")
    print(f"{'':<58}{'full':>12}{'LoRA':>12}{'ratio':>9}")
    print(f"{'qwen3-0.6b trainable params + grads + AdamW state (MiB)':<58}{full_bytes / 2**20:>12.1f}"
          f"{lora_bytes / 2**20:>12.1f}{lora_bytes / full_bytes:>9.4f}")
    print(f"{f'rl_step tokens/s, qwen3-0.6b 4 layers, {rows} x {seq_len}, fp32':<58}{tokens / full_s:>12.1f}"
          f"{tokens / lora_s:>12.1f}{full_s / lora_s:>9.2f}")
    print(f"14B LoRA 1-GPU config, compiled rl_step peak at 8K, batch {batch_shape}: {peak:.2f} GiB "
          f"(XLA:CPU with its hoisted float32 copy of the bfloat16 weights: {raw_peak:.2f} GiB)")
    print("(shared 2-core machine: other jobs run beside this one, so timings are noisy)")
    print(json.dumps({
        "lora_state_bytes_ratio": round(lora_bytes / full_bytes, 5),
        "lora_step_tokens_per_s_ratio": round(full_s / lora_s, 3),
        "lora_14b_train_peak_gib": round(peak, 2),
        "lora_14b_train_peak_gib_cpu_hoisted": round(raw_peak, 2),
        "full_step_tokens_per_s": round(tokens / full_s, 1),
        "lora_step_tokens_per_s": round(tokens / lora_s, 1),
        "device": "cpu", "cores": os.cpu_count(), "steps": _STEPS.value,
    }))


def worker(spec: str) -> None:
    framework, shape = spec.split(":")
    _, batch, seq_len = SHAPES[shape]
    config = hf_config(shape, _FULL_DEPTH.value)
    run = run_jax if framework == "jax" else run_torch
    result = run(config, batch, seq_len, _STEPS.value)
    result.update(
        tokens_per_s=batch * seq_len / result["step_s"],
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    print("RESULT " + json.dumps(result), flush=True)


def measure(framework: str, shape: str) -> dict:
    args = [
        sys.executable,
        "-m",
        "experiments.bench_train",
        f"--worker={framework}:{shape}",
        f"--steps={_STEPS.value}",
        f"--full_depth={_FULL_DEPTH.value}",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{framework}:{shape} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv):
    del argv
    if _WORKER.value:
        worker(_WORKER.value)
        return
    if _MEMORY.value:
        memory_main()
        return
    if _GPU.value:
        gpu_main()
        return
    if _LORA.value:
        lora_main()
        return
    figures = {}
    rows = []
    for shape, (_, batch, seq_len) in SHAPES.items():
        jax_result, torch_result = measure("jax", shape), measure("torch", shape)
        ratio = jax_result["tokens_per_s"] / torch_result["tokens_per_s"]
        rows.append((shape, batch, seq_len, jax_result, torch_result, ratio))
        key = shape.replace("-", "_").replace(".", "")
        figures.update(
            {
                f"{key}_jax_tokens_per_s": round(jax_result["tokens_per_s"], 1),
                f"{key}_torch_tokens_per_s": round(torch_result["tokens_per_s"], 1),
                f"{key}_speedup": round(ratio, 3),
                f"{key}_jax_peak_rss_mib": round(jax_result["peak_rss_mib"]),
                f"{key}_torch_peak_rss_mib": round(torch_result["peak_rss_mib"]),
                f"{key}_jax_compile_s": round(jax_result["compile_s"], 1),
            }
        )
    depth = "28 layers" if _FULL_DEPTH.value else "4 of 28 layers"
    print(
        f"rl_step (GRPO-RoC loss + grad + clip + AdamW, fp32) vs PyTorch/transformers Qwen3 on "
        f"{os.cpu_count()} CPU cores; median of {_STEPS.value} steps; qwen3-0.6b shape with {depth}"
    )
    print(
        f"{'shape':<12}{'batch x len':>12}{'jax tok/s':>11}{'torch tok/s':>13}{'speedup':>9}"
        f"{'jax RSS MiB':>13}{'torch RSS MiB':>15}{'compile s':>11}"
    )
    for shape, batch, seq_len, j, t, ratio in rows:
        print(
            f"{shape:<12}{f'{batch} x {seq_len}':>12}{j['tokens_per_s']:>11.1f}{t['tokens_per_s']:>13.1f}"
            f"{ratio:>9.2f}{j['peak_rss_mib']:>13.0f}{t['peak_rss_mib']:>15.0f}{j['compile_s']:>11.1f}"
        )
    print("(shared 2-core machine: other jobs run beside this one, so timings are noisy)")
    figures.update(device="cpu", cores=os.cpu_count(), steps=_STEPS.value, full_depth=_FULL_DEPTH.value)
    print(json.dumps(figures))


if __name__ == "__main__":
    bench_record.run(main)
