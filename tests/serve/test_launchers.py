"""evaluate / chat end to end on the tiny taught policy with a real sandbox, and policy loading from a
training run folder."""

import asyncio
import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from experiments.tiny_policy import ARITHMETIC, HELLO, HELLO_ANSWER
from rstar2jax.agent.rollout_types import RolloutConfig
from rstar2jax.agent.sandbox_client import SandboxClient
from rstar2jax.config import config as config_lib
from rstar2jax.config.config import write_run_config
from rstar2jax.config.parse_model import policy_options
from rstar2jax.data.chat_template import encode_text, render_chat
from rstar2jax.data.conversation import PROMPTS
from rstar2jax.engine import Engine, EngineConfig, SamplingParams
from rstar2jax.policy.loader import latest_run_params
from rstar2jax.serve import load_policy
from rstar2jax.serve.chat import ChatSession
from rstar2jax.train.checkpoint import Checkpointer
from rstar2jax.train.state import init_train_state
from sandbox_server import start_local

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launch(compile_cache_env):
    """Runs a launcher to its end (the session's compilation cache unless ``--compilation_cache_dir``)."""
    base = {**compile_cache_env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}

    def run(module, *args, stdin=None, timeout=300, env=None):
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env={**base, **(env or {})},
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture(scope="module")
def sandbox_url():
    with start_local(workers=1) as server:
        yield server.url


@pytest.mark.slow  # a minute on 2 cores; evaluation in-process: tests/eval/ (its resumable log: test_samples)
def test_evaluate_writes_samples_and_summary_and_resumes(launch, tiny_policy, sandbox_url, tmp_path):
    data = tmp_path / "arith.jsonl"
    data.write_text(
        json.dumps({"problem": ARITHMETIC, "answer": "42"})
        + "\n"
        + json.dumps({"problem": ARITHMETIC, "answer": "41"})
        + "\n"
    )
    work, cache = tmp_path / "eval", tmp_path / "cache"
    args = [
        f"--model={tiny_policy.path}",
        f"--datasets={data}",
        f"--workdir={work}",
        "--samples=3",
        "--max_tokens=160",
        "--max_turns=3",
        "--num_slots=6",
        f"--sandbox_url={sandbox_url}",
        f"--compilation_cache_dir={cache}",
    ]
    log_compiles = {"JAX_LOG_COMPILES": "1"}  # a persistent-cache hit is a log line
    first = launch("experiments.evaluate", *args, env=log_compiles)
    assert first.returncode == 0, first.stderr[-3000:]
    # The policy is prompted in the format recorded in its folder, without a flag.
    line = "prompt format: recorded with the policy; system prompt none; assistant opener '<reason>'"
    assert line in first.stdout
    assert f"compilation cache: {cache} " in first.stdout
    recorded = json.loads((work / "summary.json").read_text())["prompt"]
    assert recorded == tiny_policy.prompt.to_json_dict()
    lines = (work / "samples.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 6 and {(r["problem_index"], r["sample_index"]) for r in records} == {
        (p, s) for p in range(2) for s in range(3)
    }
    for r in records:
        assert r["dataset"] == "arith" and r["finish_reason"] in ("stop", "length", "max_turns")
        assert r["correct"] == (r["answer"] == r["gold"]) and r["response_tokens"] > 0
    summary = json.loads((work / "summary.json").read_text())["datasets"]["arith"]
    correct = np.array([[r["correct"] for r in records if r["problem_index"] == p] for p in range(2)])
    assert summary["avg@3"] == pytest.approx(correct.mean()) and summary["num_problems"] == 2
    assert {"pass@3", "maj@3", "response_tokens", "tool_calls_per_sample", "tool_error_ratio"} <= set(summary)
    assert any(r["tool_calls"] for r in records)  # the taught call ran in the sandbox
    assert "avg@3" in first.stdout  # the table

    # Killed after the first problem, in the middle of writing the second: the re-run finishes the second
    # problem only, with the samples an uninterrupted run wrote, and no line twice.
    kept = [line for line, r in zip(lines, records, strict=True) if r["problem_index"] == 0]
    (work / "samples.jsonl").write_text("\n".join(kept) + "\n" + lines[-1][:25])
    second = launch("experiments.evaluate", *args, env=log_compiles)
    assert second.returncode == 0, second.stderr[-3000:]
    # The first start filled the compilation cache, the second loads its programs from it (it may compile
    # a bucket the first never ran: it decodes one problem's samples only) and says so.
    assert "Persistent compilation cache hit" not in first.stderr and len(list(cache.iterdir())) > 10
    assert second.stderr.count("Persistent compilation cache hit") > 10
    assert re.search(r"^start-up [\d.]+ s: datasets .*imports .*weights and tokenizer ", first.stdout, re.M)
    programs = r"^(\d+) XLA programs loaded from the compilation cache, (\d+) compiled$"
    loaded = re.search(programs, second.stdout, re.M)
    assert loaded and int(loaded[1]) > 10, second.stdout[-2000:]
    again = [json.loads(line) for line in (work / "samples.jsonl").read_text().splitlines()]
    key = lambda r: (r["problem_index"], r["sample_index"])  # noqa: E731
    assert sorted(again, key=key) == sorted(records, key=key)
    third = launch("experiments.evaluate", *args)  # nothing left to do
    assert third.returncode == 0 and (work / "samples.jsonl").read_text().count("\n") == 6


@pytest.mark.slow  # 17-23 s on 2 cores: a launcher run with a tool call; the chat launcher: the tests below
def test_chat_one_shot_shows_the_call_and_its_real_output(launch, tiny_policy_dir, sandbox_url):
    result = launch(
        "experiments.chat",
        f"--model={tiny_policy_dir}",
        f"--prompt={ARITHMETIC}",
        "--temperature=0",
        f"--sandbox_url={sandbox_url}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "[python]\nprint(6 * 7)" in out and "[output: ok]\n42" in out and "\\boxed{42}" in out
    assert out.index("[python]") < out.index("[output: ok]") < out.index("\\boxed{42}")
    assert "<|im_end|>" not in out and '"arguments"' not in out  # the call is shown as code, not JSON


def test_chat_interactive_exits_cleanly_at_end_of_input(launch, tiny_policy_dir, sandbox_url):
    result = launch(
        "experiments.chat",
        f"--model={tiny_policy_dir}",
        "--temperature=0",
        "--prompt_format=bare",
        f"--sandbox_url={sandbox_url}",
        stdin=f"{HELLO}\n",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = "prompt format: --prompt_format=bare; system prompt none; assistant opener '<reason>'"
    assert line in result.stdout
    assert HELLO_ANSWER.removeprefix("<reason>") in result.stdout and result.stdout.rstrip().endswith("bye")
    assert "Unclosed" not in result.stderr and "Traceback" not in result.stderr  # no leaked aiohttp session


def test_chat_format_flags_override_a_plain_folders_format(launch, plain_policy_dir, sandbox_url):
    """A plain folder records no format (``prompt_format`` gives it the plain one, tested in test_format.py);
    the flags replace the fields of the format in use."""
    result = launch(
        "experiments.chat",
        f"--model={plain_policy_dir}",
        f"--sandbox_url={sandbox_url}",
        "--compilation_cache_dir=",
        "--assistant_opener=<think>",
        "--system_prompt=S",
        stdin="",
    )
    assert result.returncode == 0 and result.stdout.rstrip().endswith("bye"), result.stderr[-3000:]
    assert "compilation cache: off" in result.stdout
    assert (
        "prompt format: plain (the policy folder records none) and --system_prompt, --assistant_opener; "
        "system prompt 1 characters; assistant opener '<think>'"
    ) in result.stdout


def test_launchers_answer_bad_input_with_one_line_and_exit_2(tmp_path, compile_cache_env, tiny_policy_dir):
    missing = tmp_path / "missing"
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"problem": ARITHMETIC, "answer": "42"}) + "\n")
    evaluate = ["experiments.evaluate", f"--workdir={tmp_path / 'eval'}", f"--model={tiny_policy_dir}"]
    no_model = f"--model={missing}: model {str(missing)!r}: no such folder"
    cases = {
        ("experiments.serve", f"--model={missing}"): no_model,
        ("experiments.chat", f"--model={missing}"): no_model,
        (*evaluate[:2], f"--model={missing}", f"--datasets={data}"): "no such folder",
        (*evaluate, f"--datasets={missing}.jsonl"): f"--datasets: eval set '{missing}.jsonl' is neither",
        (*evaluate, "--datasets=aime24,aime99"): "--datasets: eval set 'aime99' is neither an existing file",
        (*evaluate, f"--datasets={data}", "--samples=0"): "--samples=0",
        (*evaluate, f"--datasets={data}", "--prompt_format=papr"): "--prompt_format=papr",
        (*evaluate, f"--datasets={data}", "--tools=python,no:f"): "--tools=python,no:f: tool 'no:f'",
        ("experiments.serve", f"--model={tiny_policy_dir}", "--port=70000"): "--port=70000",
        ("experiments.serve", f"--model={tiny_policy_dir}", "--max_waiting=0"): "--max_waiting=0",
        ("experiments.serve", f"--model={tiny_policy_dir}", "--drain_timeout_s=-1"): "--drain_timeout_s=-1",
    }
    env = {**compile_cache_env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    procs = {
        args: subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        for args in cases
    }  # fmt: skip
    for args, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), (args, err)
        assert cases[args] in err, (args, err)


@pytest.mark.parametrize("module", ["experiments.serve", "experiments.evaluate", "experiments.chat",
                                    "experiments.export"])
def test_help_lists_the_format_adapter_and_cache_flags(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True)
    flags = ["--compilation_cache_dir", "--adapter", "--strict_base"]
    if module != "experiments.export":
        flags += ["--system_prompt", "--assistant_opener"]
    if module in ("experiments.evaluate", "experiments.chat"):
        flags += ["--prompt_format", "--user_prefix", "--tools"]
    if module == "experiments.serve":
        flags += ["--max_waiting", "--drain_timeout_s"]
    if module == "experiments.export":
        flags += ["--output", "--overwrite", "--step"]
    for flag in flags:  # a boolean flag is listed as --[no]name
        assert flag in done.stdout or f"--[no]{flag[2:]}" in done.stdout, (module, flag)
    if module == "experiments.serve":  # the drain's default: ServerConfig's, under a 30 s grace period
        from rstar2jax.serve.server import DEFAULT_DRAIN_TIMEOUT_S

        drain_help = done.stdout[done.stdout.index("--drain_timeout_s:"):].split("\n  --", 1)[0]
        assert f"(default: '{DEFAULT_DRAIN_TIMEOUT_S}')" in " ".join(drain_help.split())


def test_chat_turns_continue_the_template_rendering(tiny_policy, sandbox_url):
    """After two turns, the token stream is the chat template's rendering of the same conversation."""
    tokenizer, prompt = tiny_policy.tokenizer, PROMPTS["bare"]()
    config = RolloutConfig(
        max_response_length=40, max_turns=2, sampling=SamplingParams(temperature=0.0), prompt=prompt
    )

    async def run():
        engine = Engine(
            tiny_policy.params,
            tiny_policy.model_config,
            EngineConfig(num_slots=1, max_len=256, eos_token_ids=tiny_policy.eos_token_ids),
        )
        async with engine, SandboxClient(sandbox_url) as sandbox:
            chat = ChatSession(engine, tokenizer, sandbox, config, max_len=256)
            first = await chat.turn(HELLO)
            second = await chat.turn("Again.")
            return chat.history, first, second

    history, first, second = asyncio.run(run())
    assert first.text.startswith(HELLO_ANSWER.removeprefix("<reason>"))
    messages = [
        {"role": "user", "content": HELLO},
        {"role": "assistant", "content": prompt.assistant_opener + first.text.removesuffix("<|im_end|>")},
        {"role": "user", "content": "Again."},
    ]
    expected = render_chat(tokenizer, messages, add_generation_prompt=True) + prompt.assistant_opener
    start = len(history) - len(second.response_ids)
    assert tokenizer.decode(history[:start]) == expected
    assert history[:start] == encode_text(tokenizer, expected)


def test_serving_an_hf_folder_loads_no_optimizer_and_no_checkpointer(tiny_policy_dir):
    """The server and an HF folder's policy need neither optax nor orbax (a run folder's checkpoint loads
    orbax when it is read)."""
    code = (
        "import sys\n"
        "from rstar2jax.serve import ChatService, load_policy\n"
        "policy = load_policy(sys.argv[1])\n"
        "print(type(policy).__name__, ChatService.__name__, sorted({'optax', 'orbax'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny_policy_dir)], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.split() == ["Policy", "ChatService", "[]"]


def test_load_policy_from_a_training_run_folder(tiny_policy, tiny_policy_dir, tmp_path):
    config = config_lib.rl_config()
    config.model.path = str(tiny_policy_dir)
    config.tokenizer = str(tiny_policy_dir)
    write_run_config(tmp_path / "run", config)
    params = jax.tree.map(lambda x: x * 1.5, tiny_policy.params)  # "trained" weights
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", async_save=False)
    checkpointer.save(4, init_train_state(tiny_policy.params, optax.adam(1e-3), 0), {}, force=True)
    checkpointer.save(7, init_train_state(params, optax.adam(1e-3), 0), {}, force=True)
    checkpointer.close()
    for where, step, expected in (
        (tmp_path / "run", None, params),
        (tmp_path / "run" / "checkpoints", 4, None),
        (tmp_path / "run" / "checkpoints" / "4", None, None),
    ):
        policy = load_policy(where, step=step)
        expected = params if expected is not None else tiny_policy.params
        assert policy.source == "run" and policy.step == (7 if step is None and where.name == "run" else 4)
        assert policy.model_config.vocab_size == tiny_policy.model_config.vocab_size
        jax.tree.map(np.testing.assert_array_equal, policy.params, expected)
        assert policy.tokenizer.chat_template == tiny_policy.tokenizer.chat_template
    # A run named by a relative work folder, as the demo's export names it (orbax needs absolute paths).
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        restored = latest_run_params(policy_options(config), pathlib.Path("run"))
    jax.tree.map(np.testing.assert_array_equal, restored.params, params)
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 5"):
        load_policy(tmp_path / "run", step=5)
    with pytest.raises(FileNotFoundError, match="neither an HF model folder"):
        load_policy(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_policy(tmp_path / "missing")
