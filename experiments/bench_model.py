"""Forward+backward tokens/s of rstar2jax's decoder against transformers' PyTorch model on this CPU.

Same config, batch, sequence length and loss (mean next-token cross-entropy, gradients for every weight),
float32. Each (shape, framework) runs in its own process pinned to the same cores with the same thread count,
so neither framework's memory or thread pool disturbs the other.

    python -m experiments.bench_model                 # both shapes
    python -m experiments.bench_model --shapes=small --steps=10

Prints a table, then as the last line a JSON object with tokens/s and the JAX/PyTorch ratios.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import flags

from experiments import bench_record

REPO = pathlib.Path(__file__).resolve().parents[1]
QWEN3_06B = REPO / "rstar2jax" / "models" / "hf_configs" / "qwen3-0.6b.json"  # models.preset("qwen3-0.6b")

SMALL_QWEN3 = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=8192, hidden_size=256,
    intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
# shape -> (HF config dict or path, batch, sequence length)
SHAPES = {
    "small": (SMALL_QWEN3, 4, 128),
    "qwen3-0.6b": (str(QWEN3_06B), 1, 64),
}


def _hf_config_dict(source) -> dict:
    if isinstance(source, dict):
        return source
    with open(source, encoding="utf-8") as f:
        return json.load(f)


def _time_steps(step, steps: int) -> float:
    """Fastest of ``steps`` calls of ``step`` after two warm-up calls (compilation, allocator): on a shared
    machine the fastest step is the one least disturbed by other processes."""
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def run_jax(hf_config: dict, batch: int, length: int, steps: int) -> float:
    import jax
    import numpy as np

    from rstar2jax import models

    config = models.config_from_hf(hf_config)
    params = models.init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, length)).astype(np.int32)

    def loss_fn(params, tokens):
        logits, _ = models.forward(params, config, tokens)
        return -models.token_logprobs(logits[:, :-1], tokens[:, 1:]).mean()

    grad_step = jax.jit(jax.value_and_grad(loss_fn))
    return _time_steps(lambda: jax.block_until_ready(grad_step(params, tokens)), steps)


def run_torch(hf_config: dict, batch: int, length: int, steps: int, threads: int) -> float:
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    config = transformers.AutoConfig.for_model(**hf_config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, config.vocab_size, (batch, length)))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss  # mean next-token cross-entropy, like run_jax
        loss.backward()

    return _time_steps(step, steps)


_SHAPES = flags.DEFINE_multi_enum("shapes", list(SHAPES), list(SHAPES), "shapes to measure")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps per measurement (fastest reported)")
_THREADS = flags.DEFINE_integer("threads", os.cpu_count(), "cores/threads for both frameworks")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "alternate fresh torch/jax processes; keep the best")
_WORKER = flags.DEFINE_string("worker", None, "internal: run one 'framework:shape' measurement")


def worker(framework: str, shape: str, steps: int, threads: int) -> None:
    source, batch, length = SHAPES[shape]
    hf_config = _hf_config_dict(source)
    if framework == "jax":
        seconds = run_jax(hf_config, batch, length, steps)
    else:
        seconds = run_torch(hf_config, batch, length, steps, threads)
    print(json.dumps({"seconds": seconds, "tokens_per_s": batch * length / seconds}))


def main(argv) -> None:
    del argv
    steps, threads, rounds = _STEPS.value, _THREADS.value, _ROUNDS.value
    if _WORKER.value:
        framework, shape = _WORKER.value.split(":")
        os.sched_setaffinity(0, set(range(threads)))  # both frameworks on the same cores
        worker(framework, shape, steps, threads)
        return

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    load_before = os.getloadavg()[0]
    best: dict[tuple[str, str], float] = {}
    for shape in _SHAPES.value:
        for _ in range(rounds):
            for framework in ("torch", "jax"):
                command = [sys.executable, __file__, f"--worker={framework}:{shape}", f"--steps={steps}",
                           f"--threads={threads}"]  # fmt: skip
                out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                tokens_per_s = json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
                best[(shape, framework)] = max(best.get((shape, framework), 0.0), tokens_per_s)

    # Other processes on a shared machine slow both frameworks (PyTorch's OpenMP barriers more): say how busy.
    load = (round(load_before, 1), round(os.getloadavg()[0], 1))
    summary = {"threads": threads, "steps": steps, "rounds": rounds, "load_avg_1min": load}
    print(f"{'shape':<12} {'batch x len':>12} {'torch tok/s':>12} {'jax tok/s':>12} {'jax/torch':>10}")
    for shape in _SHAPES.value:
        _, batch, length = SHAPES[shape]
        torch_tps, jax_tps = best[(shape, "torch")], best[(shape, "jax")]
        ratio = jax_tps / torch_tps
        print(f"{shape:<12} {f'{batch} x {length}':>12} {torch_tps:>12.1f} {jax_tps:>12.1f} {ratio:>10.2f}")
        summary[shape] = {"torch_tokens_per_s": round(torch_tps, 1), "jax_tokens_per_s": round(jax_tps, 1),
                          "ratio": round(ratio, 3)}  # fmt: skip
    print(f"machine load average (1 min) before / after: {load[0]} / {load[1]} on {os.cpu_count()} cores")
    print(json.dumps(summary))


if __name__ == "__main__":
    bench_record.run(main)
