"""The README and the docs pages run as written: every ```python block is executed, and every
`python -m ...` command is either run (with the few overrides listed here that keep it short: a temporary
work folder, fewer steps) or named with the test or CI job that runs it. A tiny Qwen3 folder (random
weights, the real Qwen3 tokenizer) stands in for ``path/to/Qwen3-0.6B``; the SFT command trains on the
shipped SFT set, its policy starts the RL one. The generated pages (config reference, Measured, API) are
``tests/test_docs.py``'s.

A new command without an entry here fails ``test_every_readme_command_is_covered``.
"""

import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import pytest

from experiments import docs_gen
from rstar2jax import models
from tests.conftest import REPO_ROOT

#: README.md and every hand-written page of the docs site, by path relative to the repository.
PAGES = {
    path.relative_to(REPO_ROOT).as_posix(): path.read_text(encoding="utf-8")
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    if not docs_gen.is_generated(path)
}
MODEL_PATH = "path/to/Qwen3-0.6B"


def _fenced_blocks(text: str, page: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block of one page, in order."""
    blocks, current, info = [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, info = [], line[3:].strip()
            else:
                blocks.append((info, "".join(current)))
                current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{page} has an unclosed code block"
    return blocks


BLOCKS = {page: _fenced_blocks(text, page) for page, text in PAGES.items()}
#: Pages whose python blocks build on each other, run in order by a test of their own (named here, which
#: must name the page): their commands are checked here, their blocks there.
BLOCKS_RUN_ELSEWHERE: dict[str, str] = {"docs/losses.md": "tests/train/test_losses_doc.py"}
#: (page, body) of every python block run here.
PYTHON_BLOCKS = [(page, body) for page, blocks in BLOCKS.items() if page not in BLOCKS_RUN_ELSEWHERE
                 for info, body in blocks if info == "python"]
# Blocks that talk to the serving guide's `experiments.serve` command: run by _serve against that server.
SERVER_BLOCKS = [(page, body) for page, body in PYTHON_BLOCKS if "OpenAI(" in body]


def _commands() -> list[str]:
    """Every ``python -m`` command of the pages: lines of plain code blocks (``\\`` continuations joined,
    comments dropped) and inline code spans outside blocks."""
    found = []
    for page, text in PAGES.items():
        for info, block in BLOCKS[page]:
            if info:
                continue
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line.startswith("python -m "):
                    found.append(re.sub(r"\s+", " ", line))
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        found += re.findall(r"`(python -m [^`]+)`", prose)
    return found


COMMANDS = _commands()

# Commands run elsewhere, with where.
COVERED_ELSEWHERE = {
    "python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b.py --dry_run": (
        "tests/train/test_launchers.py",  # test_paper_config_dry_runs_on_64_emulated_devices, by default
        ["--config=experiments/configs/paper_qwen3_14b.py", "--dry_run"],
    ),
    "python -m experiments.demo": (".ci/main", ["python -m experiments.demo"]),  # the main job
    "python -m pytest -m slow": (".ci/run", ["python -m pytest -q -m slow"]),  # CI's slow stage
    # The demo's phases with the training launchers, SFT -> RL by --config.model.path (the demo's test, slow:
    # CI's slow stage runs it).
    "python -m experiments.train_rl --config=experiments/configs/demo.py:rl --config.workdir=runs/demo_rl2": (
        "tests/test_demo.py",
        ["experiments.train_rl", "--config.model.path="],
    ),
    # DIR / W are placeholders: the three commands run on a tiny policy folder in the serve tests.
    "python -m experiments.evaluate --model=DIR --datasets=aime24,aime25,math500,hmmt25 --workdir=W": (
        "tests/serve/test_launchers.py",
        ['"experiments.evaluate"', "--datasets=", "--workdir="],
    ),
    "python -m experiments.chat --model=DIR": ("tests/serve/test_launchers.py", ['"experiments.chat"']),
    "python -m experiments.profile_step": ("tests/test_profile_step.py", ['"experiments.profile_step"']),
    # The docs' generated pages: written and compared with the committed ones by tests/test_docs.py.
    "python -m experiments.docs_gen": ("tests/test_docs.py", ["docs_gen.pages()"]),
    "python -m experiments.accelerator_check --smoke": (
        "tests/test_accelerator_check.py",
        ['"experiments.accelerator_check"', '"--smoke"'],
    ),
    # LoRA: the 14B one-GPU plan by default; BASE / DIR / W are placeholders (an adapter of another base is
    # refused by the same launcher; the merge of --adapter is load_policy's, tested in the same file).
    "python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b_lora_1gpu.py --dry_run": (
        "tests/train/test_lora.py",
        ["paper_qwen3_14b_lora_1gpu", "dry_run(options"],
    ),
    "python -m experiments.evaluate --model=BASE --adapter=DIR --datasets=aime24 --workdir=W": (
        "tests/train/test_lora.py",
        ['"experiments.evaluate"', "--adapter=", "adapter=adapter"],
    ),
    # RUN / BASE / DIR / OUT are placeholders: a LoRA RL run's folder and a base with a peft-saved adapter.
    "python -m experiments.export --model=RUN --output=OUT": (
        "tests/train/test_lora.py",
        ['"experiments.export"', "--model={killed}", "--output="],
    ),
    "python -m experiments.export --model=BASE --adapter=DIR --output=OUT": (
        "tests/serve/test_export.py",
        ['"experiments.export"', "--adapter={adapter}", "--output={out}"],
    ),
    "python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b.py "
    "--config.workdir=/shared/runs/paper --config.distributed.coordinator_address=HOST0:12355 "
    "--config.distributed.num_processes=N --config.distributed.process_id=i": (
        # HOST0 / N / i are placeholders; two processes on one machine are run by the distributed test.
        "tests/train/test_distributed.py",
        ["--num_processes=2", "--process_id="],
    ),
}
# Not run by the default suite: needs the demo's SFT policy (runs/demo) and takes ~10 min (README figure).
NOT_RUN = {
    "python -m experiments.ablate_roc": "needs the demo's SFT policy; 10 min",
    "python -m experiments.evaluate --model=runs/demo/policies/rl --tokenizer=runs/demo/tokenizer "
    "--prompt=bare --datasets=runs/demo/data/eval.jsonl --workdir=runs/demo/eval_rl --samples=4 "
    "--temperature=1.0 --max_tokens=320 --max_turns=4": "needs the demo's RL policy (the main job writes it)",
    "python -m experiments.X": "a placeholder in prose, not a command",
    "python -m experiments.bench_X": "a placeholder in prose, not a command",
    "python -m experiments.train_rl --config=experiments/configs/qwen3_1p7b_1gpu.py": (
        "needs an 80 GB GPU (its --dry_run plan is tested in tests/train/test_colocate.py)"
    ),
    "python -m experiments.bench_train --gpu": "needs a GPU",
    "python -m experiments.sft_data": "writes the shipped SFT set with a live sandbox; minutes",
    "python -m experiments.demo --config=experiments/configs/demo.py:lora": "the main job, LoRA RL; minutes",
    "python -m experiments.ablate_roc --modes=paper,lora --workdir=runs/ablate_lora": (
        "needs the demo's SFT policy; about an hour here (README figure)"
    ),
    "python -m experiments.bench_train --lora": "a benchmark (README figure); ten minutes here",
    # The record --out writes is tests/test_docs.py's (a stand-in benchmark); this one is 15-30 s here.
    "python -m experiments.bench_algo --out=docs/results/bench_algo.json": "a benchmark (README figure)",
    # FP8 rollout (issue 41): the fields through the launchers are tests/train/test_rollout_precision.py's.
    "python -m experiments.train_rl --config=experiments/configs/qwen3_1p7b_1gpu.py "
    "--config.rollout.weight_dtype=fp8 --config.rollout.kv_dtype=fp8": "needs an 80 GB GPU",
    "python -m experiments.ablate_roc --modes=paper,fp8 --workdir=runs/ablate_fp8": (
        "needs the demo's SFT policy; about an hour here"
    ),
    "python -m experiments.bench_engine --precision": "a benchmark (README figure); half an hour here",
    "python -m experiments.bench_engine --exact": "a benchmark (docs/exact_numerics.md's figures)",
    # Asynchronous RL (issue 40): the schedule itself is tests/train/test_async.py's.
    "python -m experiments.bench_async --parts=async,weights": "a benchmark (README figure); 15 minutes here",
    "python -m experiments.ablate_roc --modes=paper,async": "needs the demo's SFT policy; about an hour here",
    # The measured run behind the README's FP8 learning figure (issue 41) and the TRL comparison.
    "python -m experiments.ablate_roc --modes=paper,fp8 --seeds=0": "the demo's SFT policy; 30 min",
    "python -m experiments.bench_async --parts=trl --trl_path=DIR": "a benchmark (README figure); needs trl",
}


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    """An HF folder like Qwen3-0.6B's: the tiny preset at the real Qwen3 vocabulary, random weights, the
    bundled Qwen3 tokenizer."""
    folder = tmp_path_factory.mktemp("readme") / "Qwen3-tiny"
    config = models.preset("tiny", vocab_size=151936, eos_token_ids=(151645, 151643))
    models.save_pretrained(models.init_params(config, jax.random.key(0)), config, folder)
    for file in models.QWEN3_TOKENIZER_DIR.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def _stand_ins(text: str, model_folder) -> str:
    return text.replace(MODEL_PATH, str(model_folder))


def test_every_readme_command_is_covered():
    runs = set(RUN_WITH) | {SFT_TO_RL}
    for command in COMMANDS:
        known = runs | set(COVERED_ELSEWHERE) | set(NOT_RUN)
        assert command in known, f"command in the README or the docs not tested: {command}"
    for command, (where, needles) in COVERED_ELSEWHERE.items():
        assert command in COMMANDS, f"stale entry: {command}"
        text = (REPO_ROOT / where).read_text(encoding="utf-8")
        assert all(needle in text for needle in needles), (where, needles)
    assert all(command in COMMANDS for command in runs | set(NOT_RUN))
    assert len(PYTHON_BLOCKS) >= 3
    assert any(page == "README.md" for page, _ in PYTHON_BLOCKS), "the README's quickstart block"
    for page, test in BLOCKS_RUN_ELSEWHERE.items():
        assert page in PAGES and page.rsplit("/", 1)[-1] in (REPO_ROOT / test).read_text(encoding="utf-8")


def _exec_block(code: str, name: str) -> dict:
    namespace = {"__name__": "__readme__"}
    exec(compile(code, name, "exec"), namespace)
    return namespace


STANDALONE_BLOCKS = [(page, body) for page, body in PYTHON_BLOCKS if (page, body) not in SERVER_BLOCKS]


# Slow: the tool rollout block (a random model at the real vocabulary writes 256 tokens per sample, over a
# minute on 2 cores; tool rollouts on the taught policy: tests/agent/).
@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.slow) if "start_local" in block else i
                                   for i, (_, block) in enumerate(STANDALONE_BLOCKS)])
def test_python_block_runs(index, tiny_model_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks may write relative paths ("out/")
    page, block = STANDALONE_BLOCKS[index]
    code = _stand_ins(block, tiny_model_folder)
    namespace = _exec_block(code, f"{page} python block {index}")
    if "loss" in namespace:
        assert bool(jax.numpy.isfinite(namespace["loss"]))
    if "trajectories" in namespace:
        assert len(namespace["trajectories"]) == 2 * 4
    if "outs" in namespace:
        assert (tmp_path / "out" / "config.json").is_file() and len(namespace["outs"]) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_launcher(command: str, extra: list[str], env, timeout: int = 600) -> str:
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-m"]
    done = subprocess.run(
        [sys.executable, *argv[1:], *extra], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"{command} {extra}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _sft_then_rl(command, tmp_path, env, model_folder):
    """The README's SFT command on its shipped data, then its RL command from the exported policy folder."""
    sft_run = tmp_path / "tiny_cpu_sft"
    # Batches of 4 rows instead of 8: half the compute of the 151k-vocabulary loss, the same code path.
    _run_launcher(command, [f"--config.workdir={sft_run}", "--max_steps=2", "--config.sft.batch_size=4"], env)
    policy = sft_run / "policy"
    assert (policy / "config.json").is_file() and (policy / "tokenizer.json").is_file()
    rl_command = SFT_TO_RL.replace("runs/tiny_cpu_sft/policy", str(policy))
    _run_launcher(rl_command, [f"--config.workdir={tmp_path / 'rl'}", "--max_steps=1"], env)
    assert (tmp_path / "rl" / "metrics.jsonl").is_file()


def _print_config(command, tmp_path, env, model_folder):
    out = _run_launcher(command, [], env)
    assert "rl.keep = " in out and "# (no description)" not in out


def _train_rl(command, tmp_path, env, model_folder):
    _run_launcher(command, [f"--config.workdir={tmp_path / 'run'}", "--max_steps=1"], env)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def _roc_demo(command, tmp_path, env, model_folder):
    out = _run_launcher(command, [], env)
    assert "RoC demo: 512 prompts x 32 rollouts" in out, out[-1000:]


def _wait_healthy(server: subprocess.Popen, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                assert response.status == 200
                return
        except OSError:
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, f"the server did not answer /health in {seconds:.0f} s"
            time.sleep(0.3)


def _sandbox(command, tmp_path, env, model_folder):
    port = _free_port()  # the README's port may be taken on a shared test machine
    argv = shlex.split(command.replace("--port 8088", f"--port {port}"))
    server = subprocess.Popen([sys.executable, *argv[1:]], cwd=REPO_ROOT, env=env)
    try:
        _wait_healthy(server, port, 60)
    finally:
        server.terminate()
        server.wait(timeout=30)


def _serve(command, tmp_path, env, model_folder):
    """The OpenAI-compatible server on the tiny model (served as "rl", the name the README's client block
    uses), then the README's client blocks against it."""
    port = _free_port()
    argv = shlex.split(command.replace("DIR", str(model_folder)).replace("--port=8000", f"--port={port}"))
    server = subprocess.Popen(
        [sys.executable, *argv[1:], "--served_model_name=rl", "--max_len=256"], cwd=REPO_ROOT, env=env
    )
    try:
        _wait_healthy(server, port, 240)
        assert SERVER_BLOCKS
        for index, (page, block) in enumerate(SERVER_BLOCKS):
            namespace = _exec_block(block.replace(":8000/", f":{port}/"), f"{page} server block {index}")
            assert namespace["reply"].choices[0].message.role == "assistant"
    finally:
        server.terminate()
        server.wait(timeout=30)


# Run by _sft_then_rl on the policy the SFT command exported.
SFT_TO_RL = (
    "python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py "
    "--config.model.path=runs/tiny_cpu_sft/policy"
)

RUN_WITH = {
    "python -m experiments.sft --config=experiments/configs/tiny_cpu.py:sft": _sft_then_rl,
    "python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --print_config": _print_config,
    "python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --config.seed=1": _train_rl,
    "python -m experiments.roc_demo": _roc_demo,
    "python -m experiments.serve --model=DIR --host=127.0.0.1 --port=8000": _serve,
    "python -m sandbox_server --host 127.0.0.1 --port 8088 --workers 4": _sandbox,
}


# Slow (CI's slow stage runs them): SFT then RL on the tiny config at the real vocabulary (3 minutes on 2
# cores; by default an SFT launch runs in-process: tests/train/test_launchers.py) and from-scratch RL; the
# server launcher with the README's client blocks, whose server tests/serve/test_server.py runs by default.
SLOW_COMMANDS = {
    "python -m experiments.sft --config=experiments/configs/tiny_cpu.py:sft",
    "python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --config.seed=1",
    "python -m experiments.serve --model=DIR --host=127.0.0.1 --port=8000",
}


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_COMMANDS else c for c in sorted(RUN_WITH)],
)
def test_readme_command_runs(command, tmp_path, compile_cache_env, tiny_model_folder):
    assert command in COMMANDS, f"not in the README or the docs any more: {command}"
    RUN_WITH[command](command, tmp_path, compile_cache_env, tiny_model_folder)
