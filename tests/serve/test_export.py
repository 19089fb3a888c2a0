"""``python -m experiments.export``: a base and a PEFT adapter saved by peft itself become a plain HF folder
whose transformers logits are peft's merged logits, with the tokenizer and the prompt format; bad inputs are
one line and exit 2. (A training run folder, LoRA merged: ``tests/train/test_lora.py``.)"""

import filecmp
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from rstar2jax.data.conversation import PROMPT_CONFIG_FILE

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def export(compile_cache_env):
    def run(*args, wait=True):
        """The launcher's completed run, or (``wait=False``) the running process."""
        process = subprocess.Popen([sys.executable, "-m", "experiments.export", *args], cwd=REPO,
                                   env={**compile_cache_env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not wait:
            return process
        out, err = process.communicate(timeout=300)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    return run


def _peft_adapter(base: pathlib.Path, folder: pathlib.Path, **options):
    """A peft LoRA model on the transformers model of ``base`` (random A and B), saved to ``folder``."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **options)
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(folder)
    return peft_model


def test_a_base_and_a_peft_adapter_export_as_peft_merges_them(export, tiny_policy_dir, tmp_path):
    import torch
    import transformers

    adapter = tmp_path / "adapter"
    merged = _peft_adapter(tiny_policy_dir, adapter, target_modules="all-linear").merge_and_unload()
    out = tmp_path / "exported"
    done = export(f"--model={tiny_policy_dir}", f"--adapter={adapter}", f"--output={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"+ adapter {adapter} (merged) -> {out}" in done.stdout

    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, merged.config.vocab_size, (2, 12)))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        np.testing.assert_allclose(exported(tokens).logits.numpy(), merged(tokens).logits.numpy(),
                                   atol=2e-5, rtol=1e-5)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"  # the base's (auto)
    assert filecmp.cmp(out / PROMPT_CONFIG_FILE, tiny_policy_dir / PROMPT_CONFIG_FILE, shallow=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and len(tokenizer) == len(transformers.AutoTokenizer.from_pretrained(
        tiny_policy_dir))


def test_bad_inputs_are_one_line_and_exit_2(export, tiny_policy_dir, tmp_path):
    biased = tmp_path / "biased"
    _peft_adapter(tiny_policy_dir, biased, target_modules=["q_proj"], lora_bias=True)
    full = tmp_path / "full"
    (full / "something").mkdir(parents=True)
    cases = {
        (f"--model={tmp_path / 'missing'}", f"--output={tmp_path / 'o1'}"): "no such folder",
        (f"--model={tiny_policy_dir}", f"--adapter={biased}", f"--output={tmp_path / 'o2'}"):
            "lora_bias=True",
        (f"--model={tiny_policy_dir}", f"--output={full}"): "exists and is not empty (--overwrite",
        (f"--model={tiny_policy_dir}", f"--output={tiny_policy_dir}"): "that is, or holds, the input",
        (f"--model={tiny_policy_dir}", f"--output={tiny_policy_dir.parent}"): "that is, or holds, the input",
        (f"--model={tiny_policy_dir}",): "--output",  # required
    }
    running = {args: export(*args, wait=False) for args in cases}  # side by side: each is one start-up
    for args, process in running.items():
        _, err = process.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert process.returncode == 2 and len(lines) == 1 and cases[args] in lines[0], (args, err[-2000:])
    assert not (tmp_path / "o2").exists() and (full / "something").is_dir()
