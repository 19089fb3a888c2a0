"""Where the batch-1 decode step's time goes (issue 43): head matmul, layers, attention, sampling, the rest.

Runs the decode step of ``experiments.bench_engine``'s comparison shape (random Qwen3, 2 layers, width 256,
the real 151,936-token vocabulary, float32; one sequence holding a 32-token prompt, 16 tokens per device
call) on a warm engine, records ``--chunks`` device calls with JAX's profiler (XLA:CPU traces every thunk of
the program by its HLO instruction name) and maps each instruction to the source that made it, from XLA's
dump of the optimized program (its stack frames):

- ``head matmul``: the vocabulary-sized dot (the final norm fused into it, where XLA fuses it);
- ``sampling + log-probs``: everything over the logits (``engine/sampling.py``, the log-prob and entropy
  sums, the logits' copies);
- ``attention``: ``engine/paged_attention.py`` (page gathers, scores, the KV write);
- ``layers``: the rest of ``models/`` (projections, MLP, norms, rotary embedding);
- ``bookkeeping``: the step's own work (updates, commit, stop checks, loop control);
- ``host``: wall time per token outside the program's thunks (dispatch, reading outputs, the host loop).

Instructions without a source (XLA's dots lose it) take their operands' category. It profiles the code
of the worktree it runs in (``cd`` to another checkout and run this file by its path to compare). Prints a
table and, as the last line, one JSON object (milliseconds per token), each category as run and at its
thunks' fastest runs (each thunk's fastest of its runs, times its runs per token): on a busy machine the
first is inflated by preemption, the second much less.

Usage: ``python -m experiments.profile_step [--chunks=6] [--out=DIR]``.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from absl import app, flags

_CHUNKS = flags.DEFINE_integer("chunks", 6, "device calls (16 tokens each) recorded")
_OUT = flags.DEFINE_string("out", None, "folder for the trace and the HLO dump (default: a temporary one)")

CATEGORIES = ("head matmul", "layers", "attention", "sampling + log-probs", "bookkeeping")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_CONTAINERS = {"while", "conditional", "call"}  # their thunks hold the others: counted by their leaves


def read_module(path: str) -> dict[str, dict]:
    """Instructions of an optimized HLO dump: name -> opcode, shape, operands, op name and source files."""
    files, locations, frames, instructions = {}, {}, {}, {}
    section = None
    for line in open(path):
        line = line.rstrip("\n")
        if line in _SECTIONS:
            section = line
            continue
        entry = re.match(r"^(\d+) (.*)$", line)
        if section == "FileNames" and entry:
            files[int(entry[1])] = entry[2].strip('"')
        elif section == "FileLocations" and entry:
            locations[int(entry[1])] = int(re.search(r"file_name_id=(\d+)", line)[1])
        elif section == "StackFrames" and entry:
            frames[int(entry[1])] = (int(re.search(r"file_location_id=(\d+)", line)[1]),
                                     int(re.search(r"parent_frame_id=(\d+)", line)[1]))
        elif match := _INSTRUCTION.match(line):
            name, shape, opcode, rest = match.groups()
            frame = re.search(r"stack_frame_id=(\d+)", line)
            op_name = re.search(r'op_name="([^"]+)"', line)
            instructions[name] = dict(opcode=opcode, shape=shape, operands=re.findall(r"%([\w.\-]+)",
                                                                                      rest.split("), ")[0]),
                                      op=op_name[1] if op_name else "", frame=int(frame[1]) if frame else 0)
    for info in instructions.values():
        chain, frame, seen = [], info["frame"], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            location, frame = frames[frame]
            chain.append(files[locations[location]].replace(os.sep, "/"))
        info["files"] = chain
    return instructions


class Classifier:
    """The category of each instruction of one module (module docstring)."""

    def __init__(self, instructions: dict[str, dict], vocab: int):
        self.instructions = instructions
        self.sizes = (f"{vocab}]", f"{vocab},", f"{-(-vocab // 128)},")  # the logits, flat or in blocks

    def _vocab_sized(self, info) -> bool:
        return any(size in info["shape"] for size in self.sizes)

    def __call__(self, name: str, depth: int = 0) -> str:
        info = self.instructions[name]
        files = info["files"]
        if any(f.endswith("engine/sampling.py") for f in files):
            return "sampling + log-probs"
        vocab_sized = self._vocab_sized(info)
        if vocab_sized and (info["opcode"] == "dot" or "_dot_" in f"_{name}_"):
            return "head matmul"
        if not files and depth < 6:
            for operand in info["operands"]:
                known = self.instructions.get(operand)
                if known and known["opcode"] not in ("parameter", "constant", "get-tuple-element"):
                    category = self(operand, depth + 1)
                    if category == "head matmul":  # a copy of the logits
                        return "sampling + log-probs"
                    if category != "bookkeeping":
                        return category
        if any("attention" in f.rsplit("/", 1)[-1] for f in files):
            return "attention"
        if any("/models/" in f for f in files):
            return "layers"
        if vocab_sized or any(self._vocab_sized(self.instructions[o]) for o in info["operands"]
                              if o in self.instructions):
            return "sampling + log-probs"
        return "bookkeeping"


def split(out: str, vocab: int, tokens: int) -> tuple[dict, dict, list[tuple[float, str]]]:
    """Milliseconds per token by category from the trace and dump in ``out``: as run (each thunk's recorded
    durations) and at each thunk's fastest (its fastest run times its runs per token: what is left once a
    busy machine's preemptions are taken out); and the largest thunks (as run)."""
    events = json.load(gzip.open(glob.glob(f"{out}/trace/**/perfetto_trace.json.gz", recursive=True)[0]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    events = [e for e in events if e.get("ph") == "X"]  # complete events: thunks among them
    counts = collections.Counter(e["name"] for e in events)
    modules = [read_module(p) for p in glob.glob(f"{out}/hlo/*jit_step*after_optimizations.txt")]
    module = max(modules, key=lambda m: sum(c for n, c in counts.items() if n in m))  # the one that ran
    classify = Classifier(module, vocab)
    durations = collections.defaultdict(list)
    for event in events:
        info = module.get(event["name"])
        if info is not None and info["opcode"] not in _CONTAINERS:
            durations[event["name"]].append(event["dur"] / 1e3)  # microseconds -> ms
    as_run, fastest, thunks = (collections.Counter() for _ in range(3))
    for name, ms in durations.items():
        category = classify(name)
        as_run[category] += sum(ms) / tokens
        fastest[category] += min(ms) * len(ms) / tokens
        thunks[f"{category}: {name} ({module[name]['op'].rsplit('/', 1)[-1]})"] += sum(ms) / tokens
    return ({c: as_run[c] for c in CATEGORIES}, {c: fastest[c] for c in CATEGORIES},
            [(ms, name) for name, ms in thunks.most_common(8)])


def main(argv) -> None:
    del argv
    out = _OUT.value or tempfile.mkdtemp(prefix="profile_step_")
    dump = f"--xla_dump_to={out}/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump}".strip()
    import jax

    from experiments.bench_engine import _config, _DecodeRun, decode_steps
    from rstar2jax.engine.config import page_rounded
    from rstar2jax.models import init_params

    jax.config.update("jax_enable_compilation_cache", False)  # a cached program leaves no dump
    config = _config("tunix")
    params = init_params(config, jax.random.key(0))
    jax.block_until_ready(params)
    max_len = page_rounded(32 + 16 * (_CHUNKS.value + 8))
    run = _DecodeRun(params, config, slots=1, prompt_len=32, max_len=max_len, chunk=16,
                     chunks=_CHUNKS.value + 6)
    decode_steps([run], rounds=5)
    step_ms = run.wall_step_s * 1e3
    run.wall_times = []
    with jax.profiler.trace(f"{out}/trace", create_perfetto_trace=True):
        decode_steps([run], rounds=_CHUNKS.value)
    tokens = _CHUNKS.value * run.chunk
    traced_ms = sum(run.wall_times) / tokens * 1e3
    parts, fastest, largest = split(out, config.vocab_size, tokens)
    parts["host"] = traced_ms - sum(parts.values())
    load = os.getloadavg()[0]
    print(f"batch-1 decode step: {step_ms:.2f} ms (best chunk), {traced_ms:.2f} ms while traced; "
          f"load {load:.2f}")
    print(f"  {'ms per token':<22}{'as run':>8}{'share':>8}{'fastest':>10}")
    for name, ms in parts.items():
        print(f"  {name:<22}{ms:8.3f}{100 * ms / traced_ms:7.1f}%{fastest.get(name, float('nan')):10.3f}")
    print("largest thunks:\n" + "\n".join(f"  {ms:8.3f} ms  {name}" for ms, name in largest))
    print(f"trace and HLO dump in {out}", file=sys.stderr)
    print(json.dumps({"step_ms": round(step_ms, 3), "traced_step_ms": round(traced_ms, 3),
                      "load": round(load, 2), **{k: round(v, 3) for k, v in parts.items()},
                      **{f"fastest_{k}": round(v, 3) for k, v in fastest.items()}}))


if __name__ == "__main__":
    app.run(main)
