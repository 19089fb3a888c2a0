"""The rStar2-Agent recipe (``paper_qwen3_14b.py``) with LoRA on one 80 GB GPU: Qwen3-14B-Base frozen in
bfloat16, rank-16 adapters on all seven projections trained in float32; the paper's three stages, 2G = 32
rollouts per problem kept to G = 16 by RoC, AdamW lr 1e-6 ... everything as the paper except what one GPU
cannot hold: 32 prompts per step (the paper: 512) and 64 concurrent rollouts (the paper: 256 per engine),
and the learning rate, which LoRA needs higher (1e-5; the adapters start at the base model, B = 0).

Check the plan on any machine (no GPU needed; compiled on abstract shapes):

  python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b_lora_1gpu.py --dry_run

which prints the per-device memory plan of both phases and writes ``<workdir>/memory_plan.json``
(``rollout_peak_gib``, ``train_peak_gib``, ``device_memory_gib``). To train, point it at the base checkpoint
and the problem set:

  python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b_lora_1gpu.py \\
      --config.model.path=/ckpt/Qwen3-14B-Base --config.model.preset= \\
      --config.data.source=/data/rl_42k.jsonl

How it fits: the base's 14.8B weights in bfloat16 (27.5 GiB) get no gradient and no optimizer state; the
adapters (64M parameters), their gradients and AdamW moments take 1 GiB. While the engine runs, the base and
the moments wait in pinned host memory (``colocate.optimizer_memory="host"``) and the engine decodes from the
merged weights ``W + s A B`` (27.5 GiB, made once per step and freed after the rollout) with a KV page pool of
256K tokens (40 GiB at 160 KiB per token). Training runs one row of up to 14K tokens per micro-batch with full
rematerialisation, the MLP in 2048-token chunks and chunked vocabulary log-probs. The export writes the merged
policy as an HF folder and the adapters alone as a PEFT folder.
"""

from experiments.configs import paper_qwen3_14b


def get_config(kind: str = "rl"):
    """``kind``: "rl" (the three RL stages on one GPU) or "sft" (the non-reasoning SFT with LoRA)."""
    c = paper_qwen3_14b.get_config(kind)
    c.workdir = f"runs/paper_qwen3_14b_lora_1gpu{'_sft' if kind == 'sft' else ''}"
    c.model.param_dtype = "bfloat16"  # the frozen base; the adapters train in model.lora.dtype
    c.model.compute_dtype = "bfloat16"
    c.model.mlp_chunk_size = 2048
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.model.lora.dtype = "float32"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
    c.optimizer.learning_rate = 1e-5
    if kind == "sft":
        c.optimizer.learning_rate = 5e-5
        c.num_microbatches = 128  # one 8K row per micro-batch
        return c
    c.device_memory_gib = 80.0
    c.colocate.optimizer_memory = "host"  # the base and the moments wait in host memory during rollout
    c.rl.prompts_per_step = 32  # 32 x 32 rollouts -> 512 kept trajectories per step (the paper: 8192)
    c.num_microbatches = 512  # one trajectory (row) per micro-batch
    c.rollout.engine_slots = 64
    c.rollout.kv_cache_tokens = 256 * 1024
    c.filter_batch_size = 64
    return c
