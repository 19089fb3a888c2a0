"""Writes SFT tool-use conversations in the demo's format, every tool call run for real on a local sandbox.

  python -m experiments.sft_data --out=experiments/data/sft_tool_use.jsonl   # the shipped file (128 rows)
  python -m experiments.sft --config=experiments/configs/tiny_cpu.py:sft \\
      --config.sft.data=experiments/data/sft_tool_use.jsonl

Problems come from the synthetic integer task (``rstar2jax.data.synthetic``); each conversation is the
paper's prompt (``rstar2jax.data.conversation.PromptConfig``, the one RL rollouts use by default), a
``<reason>`` plan, a call of the Python tool, its real output, and ``<answer>`` with ``\\boxed{}``; a
``--fail_rate`` share first calls a broken version of the code, gets the real error back and fixes it. Rows
are ``{"messages", "tools", "assistant_opener"}``: ``experiments.sft`` renders them with the model's chat
template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from absl import app, flags

_OUT = flags.DEFINE_string("out", "experiments/data/sft_tool_use.jsonl", "JSONL file to write.")
_NUM = flags.DEFINE_integer("num_examples", 128, "Conversations to write.")
_FAIL_RATE = flags.DEFINE_float(
    "fail_rate", 0.35, "Share of conversations whose first call fails, then is fixed."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the problems and the injected bugs.")
_TOOL_OUTPUT_CHARS = flags.DEFINE_integer(
    "tool_output_chars", 2048, "Tool output kept per call (config.rollout.tool_output_chars of the RL run)."
)
_WORKERS = flags.DEFINE_integer("sandbox_workers", 2, "Sandbox worker processes.")


def main(argv):
    del argv
    from rstar2jax.agent.sandbox_client import SyncSandboxClient
    from rstar2jax.data.conversation import PromptConfig
    from rstar2jax.data.sft_data import build_sft_examples, sft_rows
    from rstar2jax.data.synthetic import make_task
    from rstar2jax.data.tool_result import format_tool_result
    from sandbox_server import start_local

    prompt = PromptConfig()
    task = make_task(_NUM.value, 1, seed=_SEED.value)
    with start_local(workers=_WORKERS.value) as server, SyncSandboxClient(server.url) as client:
        examples = build_sft_examples(
            task.train,
            lambda code, stdin: dataclasses.asdict(client.run(code, stdin)),
            prompt=prompt,
            format_tool_output=functools.partial(format_tool_result, max_chars=_TOOL_OUTPUT_CHARS.value),
            fail_rate=_FAIL_RATE.value,
            seed=_SEED.value,
            max_workers=4,
        )
    out = pathlib.Path(_OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in sft_rows(examples, prompt))
    kinds = sorted({e.bug_kind or "none" for e in examples})
    counts = {k: sum((e.bug_kind or "none") == k for e in examples) for k in kinds}
    size = out.stat().st_size / 1024
    print(f"{len(examples)} conversations -> {out} ({size:.0f} KiB); first-call bugs {counts}")


if __name__ == "__main__":
    app.run(main)
