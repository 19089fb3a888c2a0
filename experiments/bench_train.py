"""Benchmark: ``rl_step`` (GRPO-RoC loss, gradient, clip, AdamW) tokens/s against the same update written in
PyTorch on transformers' Qwen3, same shapes, batch and sequence length, on this CPU.

  python -m experiments.bench_train [--steps=5] [--full_depth]

Each (framework, shape) runs in its own subprocess, so peak memory (max RSS) is its own. Both sides compute
the same thing per step: forward, token log-probs, clipped surrogate with ε 0.2/0.28 and the token-mean
normaliser, the policy entropy (for logging, no gradient), backward, global-norm clip 1.0, AdamW (lr 1e-6,
wd 0.01), float32 throughout. Shapes: a small Qwen3, and the Qwen3-0.6B layer and vocabulary shape with 4 of
its 28 layers and one row (fp32 weights + AdamW of all 28 need ~10 GiB per process, too much for a shared
24 GiB machine; --full_depth runs them). Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 5, "timed steps per run (after one warm-up step)")
_FULL_DEPTH = flags.DEFINE_bool("full_depth", False, "run all 28 layers of the Qwen3-0.6B shape")
_WORKER = flags.DEFINE_string("worker", None, "internal: run one 'framework:shape' measurement")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_06B = os.path.join(REPO, "rstar2jax", "models", "hf_configs", "qwen3-0.6b.json")  # preset "qwen3-0.6b"
SMALL = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    tie_word_embeddings=False,
)
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
    import jax
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
        old_logp=old_logp,
    )
    data = jax.device_put(data)
    optimizer = train.make_optimizer()
    state = train.init_train_state(models.init_params(model_config, jax.random.PRNGKey(0)), optimizer, 0)
    step = train.make_rl_step(model_config, optimizer)
    start = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    state, metrics = compiled(state, data)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
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
    app.run(main)
