"""Chat with a policy in the terminal; its Python calls really run, and you see them as they happen.

  python -m experiments.chat --model=runs/demo/policies/rl
  python -m experiments.chat --model=DIR --prompt="What is 2**100 mod 7?"   # one answer, then exit
  python -m experiments.chat --model=BASE --adapter=LORA_DIR   # a PEFT LoRA adapter merged into BASE

The model's reasoning is printed as it is sampled, each Python call as code and its real output as it comes
back (sandbox: a local one, or ``--sandbox_url``). Later messages continue the same conversation. Ctrl-C or
Ctrl-D (end of input) exits cleanly. The policy is prompted in the format recorded in its folder (a plain HF
folder: ``--prompt_format=plain``); the format flags override it. A missing model folder or a bad flag value
is one line and exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys

from absl import flags

from experiments import _launch, _policy_flags

_MODEL = flags.DEFINE_string("model", None, "HF model folder, hub name, or training run folder.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer folder (default: the model's).")
_ADAPTER = _policy_flags.define_adapter_flags()
_PROMPT = flags.DEFINE_string("prompt", None, "Answer this one message and exit (for scripts).")
_policy_flags.define_format_flags(problem_prompt=True)
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", 4096, "Tokens per assistant turn (tool output included).", lower_bound=1
)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 10, "Model turns (tool rounds) per message.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature (0: greedy).", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold, in (0, 1].", upper_bound=1.0)
_MAX_LEN = flags.DEFINE_integer("max_len", 16384, "Context length of the whole chat.", lower_bound=2)
_SEED = flags.DEFINE_integer("seed", None, "Seed for reproducible answers.")
_SANDBOX_URL = flags.DEFINE_string("sandbox_url", None, "Sandbox server URL; default: start a local one.")
_policy_flags.define_tools_flag()
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")
flags.mark_flag_as_required("model")


def main(argv):
    del argv
    from rstar2jax.agent.rollout_types import RolloutConfig
    from rstar2jax.agent.sandbox_client import SandboxClient
    from rstar2jax.engine import Engine, EngineConfig, SamplingParams, page_rounded
    from rstar2jax.serve.chat import ChatSession, TerminalObserver

    if not _TOP_P.value > 0:
        _launch.fail(f"--top_p={_TOP_P.value}: must be in (0, 1]")
    policy = _policy_flags.load_policy_or_exit(
        _MODEL.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, adapter=_ADAPTER.value
    )
    config = RolloutConfig(
        max_response_length=_MAX_TOKENS.value,
        max_turns=_MAX_TURNS.value,
        sampling=SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value),
        prompt=_policy_flags.format_from_flags(policy),
        seed=_SEED.value,
        segment_tokens=8,
    )
    engine = Engine(
        policy.params,
        policy.model_config,
        EngineConfig(
            num_slots=1,
            max_len=page_rounded(_MAX_LEN.value),
            eos_token_ids=policy.eos_token_ids,
            seed=_SEED.value or 0,
        ),
    )
    observer = TerminalObserver(hide=(policy.tokenizer.eos_token,), opener=config.prompt.assistant_opener)
    interactive = _PROMPT.value is None
    with contextlib.ExitStack() as stack:
        url = _SANDBOX_URL.value
        if not url:
            from sandbox_server import start_local

            url = stack.enter_context(start_local(workers=1)).url
        runner = stack.enter_context(asyncio.Runner())
        sandbox = SandboxClient(url, default_timeout=config.tool_timeout)
        tools, prompt = _policy_flags.tools_from_flags(sandbox, config.prompt)
        config = dataclasses.replace(config, prompt=prompt)
        runner.run(engine.__aenter__())
        stack.callback(lambda: runner.run(sandbox.close()))
        stack.callback(lambda: runner.run(engine.__aexit__(None, None, None)))
        chat = ChatSession(engine, policy.tokenizer, sandbox, config, max_len=_MAX_LEN.value, tools=tools)
        if interactive:
            print(f"chatting with {policy.path}; Ctrl-D or Ctrl-C exits", flush=True)
            print(_policy_flags.describe_format(policy, config.prompt), flush=True)
            print(_launch.compilation_cache_line(), flush=True)
        try:
            while True:
                message = _PROMPT.value if not interactive else input("\nyou> ")
                if interactive and not message.strip():
                    continue
                if interactive:
                    print("model> ", end="", flush=True)
                try:
                    runner.run(chat.turn(message, observer))
                except ValueError as error:  # the chat outgrew the context
                    print(f"\n{error}", file=sys.stderr)
                    if not interactive:
                        sys.exit(1)
                print(flush=True)
                if not interactive:
                    break
        except (KeyboardInterrupt, EOFError):
            print("\nbye", flush=True)


if __name__ == "__main__":
    _launch.run(main)
