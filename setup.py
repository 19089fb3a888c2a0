"""rstar2jax: agentic reasoning RL (rStar2-Agent / GRPO-RoC) in JAX."""

import sys

from setuptools import Extension, find_packages, setup

# The documentation site's tools (the `docs` extra; also in `test`: the default test run builds the site).
# griffelib is the griffe that experiments/docs_api.py reads the sources with, as mkdocstrings does.
DOCS = ["mkdocs>=1.6.1", "mkdocs-material>=9.8", "mkdocstrings[python]>=1.0.8", "griffelib>=2.4"]

# sandbox_server's fork server, which forks and isolates each call in C (Linux only). Optional: without a
# compiler the build goes on and the workers do the same in Python (sandbox_server.isolation), ~20% slower
# per trivial call.
native = [Extension("sandbox_server._spawn", ["sandbox_server/_spawn.c"], optional=True)]

setup(
    name="rstar2jax",
    version="0.1.0",
    description="rStar2-Agent in JAX: GRPO-RoC, a fast code sandbox and an agentic rollout engine",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The launchers and benchmarks (experiments/) run from the checkout: python -m experiments.X.
    packages=find_packages(include=["rstar2jax", "rstar2jax.*", "sandbox_server", "sandbox_server.*"]),
    # Data the library reads at run time: eval sets, Qwen3 architecture configs, the Qwen3 tokenizer (each
    # folder's README gives source and licence).
    package_data={
        "rstar2jax.eval": ["sets/*.jsonl", "sets/README.md"],
        "rstar2jax.models": ["hf_configs/*.json", "hf_configs/README.md", "tokenizers/*/*"],
    },
    ext_modules=native if sys.platform.startswith("linux") else [],
    install_requires=[
        "jax>=0.10.2,<0.12",  # models.platform.SUPPORTED_JAX: 0.10.2 (CPU pin) through 0.11.x (GPU images)
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "transformers>=5.23",
        "jinja2>=3.1",  # transformers' apply_chat_template renders chat templates with it, undeclared there
        "tokenizers>=0.23",
        "safetensors>=0.8",
        "datasets>=5.2",
        "numpy>=2.4",
        "msgpack>=1.2",
        "aiohttp>=3.14",
        "absl-py>=2.5",
        "ml-collections>=1.1",
        "math-verify>=0.9",
        "sympy>=1.14",
        "tqdm>=4.70",
        "tensorboardX>=2.6.5",
        "matplotlib>=3.11",
    ],
    extras_require={
        # GPU backends: JAX's plugins at the JAX version this project is tested with. Pick the one that
        # matches the machine's driver (`nvidia-smi` shows the CUDA version; ROCm 7 for AMD Instinct GPUs).
        # On NVIDIA, tokamax's fused attention kernels come too (models.attention "auto"); its private Mask
        # API is used, hence the pin. Without it "auto" uses the blockwise XLA attention.
        "cuda": ["jax[cuda12]==0.10.2", "tokamax==0.0.12"],
        "cuda13": ["jax[cuda13]==0.10.2", "tokamax==0.0.12"],
        "rocm": ["jax[rocm7-local]==0.10.2"],
        # The TensorBoard viewer for the events the launchers write (`tensorboard --logdir <workdir>`).
        "tensorboard": ["tensorboard>=2.21"],
        # Weights & Biases as a run logger (config.logging.wandb; docs/cluster.md); the library runs without.
        "wandb": ["wandb>=0.31"],
        # google-tunix, the side `bench_engine --startup` compares decoding with. Bench-only, and for an
        # environment of its own: it pins transformers 5.12. Beside this project, install it into a folder
        # with --no-deps instead (see experiments/bench_engine.py) and pass --tunix_path.
        # trl, whose GRPOTrainer `bench_async` compares one GRPO step with (its dependencies are this
        # project's): beside this project, `pip install --no-deps --target DIR trl==1.16.0`, --trl_path=DIR.
        "bench": ["google-tunix==0.1.7", "trl==1.16.0"],
        # The documentation site (`mkdocs serve`, `mkdocs build --strict`; mkdocs.yml at the root): Material
        # for MkDocs and the API reference from the docstrings (mkdocstrings' Python handler, on griffe).
        "docs": DOCS,
        # torch is only for parity tests and benchmarks against transformers (CPU build, pinned); the docs'
        # tools because the default test run builds the site.
        "test": [
            *DOCS,
            "pytest>=9.2",
            "pytest-xdist>=3.8",
            "hypothesis>=6.170",
            "nbclient>=0.11",
            "nbformat>=5.11",
            "ipykernel>=7.4",
            "jupyter-client>=8.10",
            "traitlets>=5.16",
            "ruff>=0.17",
            "openai>=1.0",  # the serving tests drive the server with the official client
            "torch==2.13.0",
            "peft==0.21.2",  # the LoRA tests load our adapter folders with PEFT itself
            "prometheus-client>=0.20",  # the serving tests parse /metrics with Prometheus' own parser
            "tokamax==0.0.12",  # its XLA kernels check the segment mask the GPU kernels get
            "wandb>=0.31",  # the W&B logger's offline run files (tests/train/test_wandb.py)
        ],
    },
)
