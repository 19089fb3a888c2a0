"""Evaluate a policy with the paper's protocol: average pass@1 over 16 samples at temperature 0.6, up to 30
turns and 30K tokens, with the Python tool really executed.

  python -m experiments.evaluate --model=DIR_OR_HUB_NAME --datasets=aime24,aime25,math500,hmmt25 --workdir=W

Writes ``W/samples.jsonl`` (one record per sample: response, extracted answer, correctness, tool calls,
turns, tokens, finish reason) and ``W/summary.json`` (per dataset: avg@k, pass@k, maj@k, mean response
tokens, tool-call statistics), and prints the table. Re-running the same command resumes: finished problems
are skipped and no line is written twice. ``--datasets`` takes eval-set names and ``.jsonl`` files of
``{"problem", "answer"}`` rows; ``--model`` an HF folder, a hub name or a training run folder; ``--adapter`` a
PEFT LoRA folder merged into an HF base ``--model`` (``--model=BASE --adapter=DIR``). The policy is prompted
in the format recorded in its folder (a plain HF folder: ``--prompt_format=plain``); the format flags override
it. A missing model folder or dataset, an unknown eval-set name or a bad flag value is one line and exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

from absl import flags

from experiments import _launch, _policy_flags

_MODEL = flags.DEFINE_string("model", None, "HF model folder, hub name, or training run folder.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer folder (default: the model's).")
_ADAPTER = _policy_flags.define_adapter_flags()
_DATASETS = flags.DEFINE_list(
    "datasets", ["aime24", "aime25", "math500", "hmmt25"], "Eval-set names or .jsonl files (problem, answer)."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where samples.jsonl and summary.json go.")
_SAMPLES = flags.DEFINE_integer("samples", 16, "Samples per problem (k).", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature.", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold, in (0, 1].", upper_bound=1.0)
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", 30_000, "Response budget per sample (tool output included).", lower_bound=1
)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 30, "Assistant turns per sample.", lower_bound=1)
_LIMIT = flags.DEFINE_integer(
    "limit", None, "Evaluate only the first N problems of each dataset.", lower_bound=1
)
_SANDBOX_URL = flags.DEFINE_string("sandbox_url", None, "Sandbox server URL; default: start a local one.")
_SANDBOX_WORKERS = flags.DEFINE_integer("sandbox_workers", 2, "Workers of the local sandbox.", lower_bound=1)
_policy_flags.define_format_flags(problem_prompt=True)
flags.DEFINE_alias("prompt", "prompt_format")  # the flag's earlier name
_NUM_SLOTS = flags.DEFINE_integer(
    "num_slots", 32, "Sequences the engine decodes side by side.", lower_bound=1
)
_policy_flags.define_tools_flag()
_SEED = flags.DEFINE_integer("seed", 0, "Seeds every problem's samples.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")
flags.mark_flags_as_required(["model", "workdir"])


def load_datasets(names: list[str], limit: int | None) -> dict:
    """Eval sets by name (a file's stem): one line and exit 2 for a missing file, an unknown eval-set name,
    a file without usable rows, or two datasets of one name."""
    from rstar2jax.eval import load_eval_set

    if not names:
        _launch.fail("--datasets is empty: give eval-set names or .jsonl files")
    datasets = {}
    for name in names:
        key = pathlib.Path(name).stem if pathlib.Path(name).suffix else name
        if key in datasets:
            _launch.fail(f"--datasets: two datasets are named {key!r}")
        try:
            datasets[key] = load_eval_set(name, limit=limit)
        except (OSError, ValueError) as error:
            _launch.fail(f"--datasets: {error}")
        if not datasets[key]:
            _launch.fail(f"--datasets: {name} holds no problems")
    return datasets


def main(argv):
    del argv
    workdir = pathlib.Path(_WORKDIR.value)
    if workdir.exists() and not workdir.is_dir():
        _launch.fail(f"--workdir={workdir}: exists and is not a folder")
    if not _TOP_P.value > 0:
        _launch.fail(f"--top_p={_TOP_P.value}: must be in (0, 1]")
    clock = _launch.StartupClock()
    datasets = load_datasets(_DATASETS.value, _LIMIT.value)  # before the heavy imports: a bad name fails fast
    clock.mark("datasets")

    from rstar2jax.agent.sandbox_client import SandboxClient
    from rstar2jax.eval.evaluate import EvalProtocol, evaluate_to_files
    from rstar2jax.eval.samples import format_summary
    from rstar2jax.reward import AnswerVerifier

    clock.watch_programs()
    clock.mark("imports")

    protocol = EvalProtocol(
        samples=_SAMPLES.value,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        max_tokens=_MAX_TOKENS.value,
        max_turns=_MAX_TURNS.value,
        seed=_SEED.value,
    )
    policy = _policy_flags.load_policy_or_exit(
        _MODEL.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, adapter=_ADAPTER.value
    )
    clock.mark("weights and tokenizer")
    _, prompt = _policy_flags.tools_from_flags(None, _policy_flags.format_from_flags(policy))
    print(
        f"model {policy.path} ({policy.source}{'' if policy.step is None else f', step {policy.step}'})"
        f"{'' if policy.adapter is None else f' + adapter {policy.adapter}'}; "
        f"{', '.join(f'{n}: {len(p)}' for n, p in datasets.items())} problems; k={protocol.samples}, "
        f"T={protocol.temperature}, {protocol.max_tokens} tokens, {protocol.max_turns} turns",
        flush=True,
    )
    print(_policy_flags.describe_format(policy, prompt), flush=True)
    print(_launch.compilation_cache_line(), flush=True)
    print(clock.line(), flush=True)
    print(f"writing {workdir / 'samples.jsonl'} and {workdir / 'summary.json'}", flush=True)

    async def run(url: str):
        async with SandboxClient(url, default_timeout=protocol.tool_timeout) as sandbox:
            tools, _ = _policy_flags.tools_from_flags(sandbox, prompt)
            return await evaluate_to_files(
                policy,
                datasets,
                workdir,
                sandbox=sandbox,
                verifier=verifier,
                protocol=protocol,
                prompt=prompt,
                num_slots=_NUM_SLOTS.value,
                progress=True,
                tools=tools,
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
    print(clock.programs_line(), flush=True)


if __name__ == "__main__":
    _launch.run(main)
