"""Evaluate a policy with the paper's protocol: average pass@1 over 16 samples at temperature 0.6, up to 30
turns and 30K tokens, with the Python tool really executed.

  python -m experiments.evaluate --model=DIR_OR_HUB_NAME --datasets=aime24,aime25,math500,hmmt25 --workdir=W

Writes ``W/samples.jsonl`` (one record per sample: response, extracted answer, correctness, tool calls,
turns, tokens, finish reason) and ``W/summary.json`` (per dataset: avg@k, pass@k, maj@k, mean response
tokens, tool-call statistics), and prints the table. Re-running the same command resumes: finished problems
are skipped and no line is written twice. ``--datasets`` takes eval-set names and ``.jsonl`` files of
``{"problem", "answer"}`` rows; ``--model`` an HF folder, a hub name or a training run folder;
``--adapter`` a PEFT LoRA folder merged into an HF base ``--model`` (``--model=BASE --adapter=DIR``).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

from absl import app, flags

from experiments import _launch

_MODEL = flags.DEFINE_string("model", None, "HF model folder, hub name, or training run folder.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer folder (default: the model's).")
_ADAPTER = flags.DEFINE_string("adapter", None, _launch.ADAPTER_HELP)
_DATASETS = flags.DEFINE_list(
    "datasets", ["aime24", "aime25", "math500", "hmmt25"], "Eval-set names or .jsonl files (problem, answer)."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where samples.jsonl and summary.json go.")
_SAMPLES = flags.DEFINE_integer("samples", 16, "Samples per problem (k).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 30_000, "Response budget per sample (tool output included).")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 30, "Assistant turns per sample.")
_LIMIT = flags.DEFINE_integer("limit", None, "Evaluate only the first N problems of each dataset.")
_SANDBOX_URL = flags.DEFINE_string("sandbox_url", None, "Sandbox server URL; default: start a local one.")
_SANDBOX_WORKERS = flags.DEFINE_integer("sandbox_workers", 2, "Workers of the local sandbox.")
_PROMPT = flags.DEFINE_enum("prompt", "paper", ["paper", "bare"], "The prompt the policy was trained with.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 32, "Sequences the engine decodes side by side.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds every problem's samples.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")
flags.mark_flags_as_required(["model", "workdir"])


def main(argv):
    del argv
    from rstar2jax.agent.sandbox_client import SandboxClient
    from rstar2jax.eval import load_eval_set
    from rstar2jax.reward import AnswerVerifier
    from rstar2jax.serve.evaluation import PROMPTS, EvalProtocol, evaluate_to_files, format_summary

    workdir = pathlib.Path(_WORKDIR.value)
    datasets = {
        pathlib.Path(d).stem if d.endswith(".jsonl") else d: load_eval_set(d, limit=_LIMIT.value)
        for d in _DATASETS.value
    }
    protocol = EvalProtocol(
        samples=_SAMPLES.value,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        max_tokens=_MAX_TOKENS.value,
        max_turns=_MAX_TURNS.value,
        seed=_SEED.value,
    )
    policy = _launch.load_policy(
        _MODEL.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, adapter=_ADAPTER.value
    )
    print(
        f"model {policy.path} ({policy.source}{'' if policy.step is None else f', step {policy.step}'})"
        f"{'' if policy.adapter is None else f' + adapter {policy.adapter}'}; "
        f"{', '.join(f'{n}: {len(p)}' for n, p in datasets.items())} problems; k={protocol.samples}, "
        f"T={protocol.temperature}, {protocol.max_tokens} tokens, {protocol.max_turns} turns",
        flush=True,
    )
    print(f"writing {workdir / 'samples.jsonl'} and {workdir / 'summary.json'}", flush=True)

    async def run(url: str):
        async with SandboxClient(url, default_timeout=protocol.tool_timeout) as sandbox:
            return await evaluate_to_files(
                policy,
                datasets,
                workdir,
                sandbox=sandbox,
                verifier=verifier,
                protocol=protocol,
                prompt=PROMPTS[_PROMPT.value](),
                num_slots=_NUM_SLOTS.value,
                progress=True,
            )

    with contextlib.ExitStack() as stack:
        url = _SANDBOX_URL.value
        if not url:
            from sandbox_server import start_local

            url = stack.enter_context(start_local(workers=_SANDBOX_WORKERS.value)).url
        verifier = stack.enter_context(AnswerVerifier(num_workers=2))
        try:
            summary = asyncio.run(run(url))
        except KeyboardInterrupt:
            print("\ninterrupted: finished problems are saved; re-run the same command to resume", flush=True)
            sys.exit(130)
    print(format_summary(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
