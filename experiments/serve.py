"""An OpenAI-compatible chat-completions server for a trained policy, on the continuous-batching engine.

  python -m experiments.serve --model=runs/demo/rl_policy --host=127.0.0.1 --port=8000

Then any OpenAI client works::

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.chat.completions.create(model="rl_policy", messages=[{"role": "user", "content": "2+2?"}])

``--model`` is an HF folder (or hub name) or a training run folder (its latest checkpoint); ``--adapter`` a
PEFT LoRA folder merged into an HF base ``--model`` (``--model=BASE --adapter=DIR``). A policy is served in
the conversation format it was trained in (recorded in its folder: the system prompt of requests without one,
the assistant opener); a plain HF folder with its chat template and nothing added; ``--system_prompt`` and
``--assistant_opener`` override either. Concurrent requests share the engine's slots (``--num_slots``); more
wait in its queue, at most ``--max_waiting`` (default 8 per slot) at once: one more is answered 429 with a
``Retry-After``. ``GET /metrics`` is Prometheus' text format (JSON with ``Accept: application/json`` or
``?format=json``).

SIGTERM or Ctrl-C drains the server: new requests get 503 and ``/health`` says draining, the requests in
flight have ``--drain_timeout_s`` (25: inside the usual 30 s termination grace period) to finish, then each
stream still running ends with a last chunk whose ``finish_reason`` is ``abort`` and ``data: [DONE]`` (a
waiting or non-streamed request gets 503); the process then exits 0. A second signal ends the wait at once. A
missing model folder or a bad flag value is one line and exit 2.
"""

from __future__ import annotations

import asyncio

from absl import flags

from experiments import _launch, _policy_flags

_MODEL = flags.DEFINE_string("model", None, "HF model folder, hub name, or training run folder.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer folder (default: the model's).")
_ADAPTER = _policy_flags.define_adapter_flags()
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=1, upper_bound=65535)
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 16, "Sequences decoded side by side.", lower_bound=1)
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 2048, "Context length (prompt + completion) per sequence.", lower_bound=2
)
_KV_POOL = flags.DEFINE_float(
    "kv_pool_gib", None, "GiB of KV cache pages (what bounds memory); default: every slot at --max_len.",
    lower_bound=0,
)
_PREFIX_CACHE = flags.DEFINE_bool(
    "prefix_cache", True, "Reuse the keys/values of prompt prefixes already in the pool (earlier turns)."
)
_MAX_WAITING = flags.DEFINE_integer(
    "max_waiting", None, "Most requests waiting at once (arrived, not generating yet); one more gets 429 "
    "with Retry-After. Default: 8 per slot (128 at 16 slots).", lower_bound=1,
)
_DRAIN_TIMEOUT = flags.DEFINE_float(  # the default is ServerConfig's (importing it here would start JAX)
    "drain_timeout_s", 25.0, "After SIGTERM / Ctrl-C: seconds the requests in flight have to "
    "finish before they are ended (a stream with finish_reason abort and [DONE]); the default leaves margin "
    "under the usual 30 s termination grace period.", lower_bound=0.0,
)
_policy_flags.define_format_flags(problem_prompt=False)
_NAME = flags.DEFINE_string("served_model_name", None, "Model id clients use (default: the folder name).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile the engine's programs before reporting healthy.")
flags.mark_flag_as_required("model")


def main(argv):
    del argv
    clock = _launch.StartupClock()
    from rstar2jax.serve import ServerConfig, run_server
    from rstar2jax.serve.server import served_format

    clock.watch_programs()
    clock.mark("imports")
    policy = _policy_flags.load_policy_or_exit(
        _MODEL.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, adapter=_ADAPTER.value
    )
    clock.mark("weights and tokenizer")
    config = ServerConfig(
        num_slots=_NUM_SLOTS.value,
        max_len=_MAX_LEN.value,
        kv_pool_gib=_KV_POOL.value,
        prefix_cache=_PREFIX_CACHE.value,
        assistant_opener=flags.FLAGS.assistant_opener,
        system_prompt=flags.FLAGS.system_prompt,
        model_name=_NAME.value,
        warmup=_WARMUP.value,
        max_waiting=_MAX_WAITING.value,
        drain_timeout_s=_DRAIN_TIMEOUT.value,
    )
    ready = asyncio.Event()

    async def announce():
        await ready.wait()
        clock.mark("engine and programs")
        print(clock.line(), flush=True)
        name = config.model_name or policy.name
        print(
            f"serving {name!r} ({policy.source}: {policy.path}) at http://{_HOST.value}:{_PORT.value}/v1"
            f" - {config.num_slots} slots x {config.max_len} tokens, at most {config.waiting_bound} waiting;"
            f" Ctrl-C or SIGTERM drains and stops",
            flush=True,
        )

    async def serve():
        await asyncio.gather(run_server(policy, config, _HOST.value, _PORT.value, ready), announce())

    print(_policy_flags.describe_format(policy, served_format(policy, config)), flush=True)
    print(_launch.compilation_cache_line(), flush=True)
    try:
        asyncio.run(serve())  # returns once a signal has drained it
    except KeyboardInterrupt:  # a signal before the server was up
        pass
    except OSError as error:  # the address is taken or cannot be bound
        _launch.fail(f"cannot listen on --host={_HOST.value} --port={_PORT.value}: {error}")
    print("stopped", flush=True)


if __name__ == "__main__":
    _launch.run(main)
