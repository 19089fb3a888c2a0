"""What every launcher shares (``experiments.sft``, ``train_rl``, ``demo``, ``ablate_roc``, ``evaluate``,
``chat``, ``serve``):

- flag parsing and errors: a bad config value, override or flag exits 2 with one line naming the field, the
  value and what is allowed, never a traceback;
- ``--print_config``: every config field with its value and meaning;
- at start, where the run writes: work folder, checkpoint folder, metrics file, the ``tensorboard --logdir``
  line (and the config's ``notice``, e.g. that it is a smoke test);
- JAX's persistent compilation cache, on by default (``--compilation_cache_dir``): a second start loads the
  programs the first one compiled instead of compiling them again;
- what the library logs (the ``rstar2jax`` loggers: progress lines, resumes, the memory plan) shown as bare
  lines, INFO on stdout and warnings on stderr (``console_logging``);
- Ctrl-C: the training loop finishes its step, saves a checkpoint and the launcher exits (status 130) with
  one line saying where; a second Ctrl-C stops at once. SIGTERM (a scheduler's preemption) does the same as
  the first Ctrl-C. A launcher that trains wraps the loop in ``stop_on_signals`` and passes the
  ``StopSignal`` it gives to ``train_rl`` / ``train_sft``; elsewhere either signal interrupts at once;
- a fault the run cannot ride out (a sandbox that stayed down past ``rollout.sandbox_outage_s``, too many
  non-finite steps in a row, a checkpoint that could not be written): one line ``error: ...`` saying what
  happened and which checkpoint a rerun resumes from, exit 3.

  from experiments import _launch
  if __name__ == "__main__":
      _launch.run(main)
"""

from __future__ import annotations

import contextlib
import logging as pylogging
import os
import pathlib
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from absl import app, flags, logging

#: Exit status of a bad config value or command line (absl's own usage errors exit 1).
CONFIG_ERROR_EXIT = 2
#: Exit status after an interruption (128 + SIGINT, as a shell reports it).
INTERRUPTED_EXIT = 130
#: Exit status of a run stopped by a fault it cannot ride out (the last finished step's checkpoint is kept).
FAULT_EXIT = 3
#: Exit status of a run stopped by a broken schedule invariant (a bug: the message names the checkpoint).
INVARIANT_EXIT = 1
PRINT_CONFIG_HELP = "List every config field (after overrides) with its value and meaning, then exit."

_IMPORTED = time.perf_counter()  # the launcher's start, as near as a module can see it
_announced: list[pathlib.Path] = []  # checkpoint folders of this invocation, for the interruption line
COMPILATION_CACHE_FLAG = "compilation_cache_dir"
_compilation_cache: list[str | None] = []  # the folder this invocation caches programs in (None: off)


def fail(message: str, status: int = CONFIG_ERROR_EXIT) -> None:
    """Prints ``error: message`` as one line on stderr and exits with ``status``."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(status)


def _override_arg(argv: list[str], key: str) -> str:
    """The ``--config.a.b=...`` argument whose path names ``key`` (for the message), or ''."""
    for arg in argv:
        name = arg.lstrip("-").split("=", 1)[0]
        if re.search(rf"\.{re.escape(key)}(\.|\[|$)", name):
            return arg
    return ""


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing where every failure (an unknown flag or config field, a value of the wrong type, a
    config file that does not load) is one line and exit 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fields = ", --print_config the config fields" if "print_config" in flags.FLAGS else ""
        fail(f"{e} (--help lists the flags{fields})")
    except (AttributeError, KeyError) as e:  # an override naming no config field (ml_collections)
        _unknown_field(argv, e)
    return []  # not reached


def _unknown_field(argv: list[str], error: Exception) -> None:
    detail: object = error
    while isinstance(detail, BaseException) and detail.args:  # AttributeError(KeyError("'kep'\nDid..."))
        detail = detail.args[0]
    key, _, hint = str(detail).partition("\n")
    key = key.strip("'\"")
    arg = _override_arg(argv[1:], key)
    hint = _moved_field(arg) or hint
    fail(f"{arg or 'config override'}: no config field {key!r}{'; ' + hint if hint else ''}")


def _moved_field(arg: str) -> str:
    """Where the field an override names went, when it is one that moved (``config.parse.MOVED``), else ''."""
    from rstar2jax.config.parse import MOVED

    parts = arg.lstrip("-").split("=", 1)[0].split(".")[1:]  # config.rl.loss.temperature -> rl, loss, ...
    for start in range(len(parts)):
        if (path := ".".join(parts[start:])) in MOVED:
            return MOVED[path]
    return ""


def define_config(default: str | None, help_text: str, *, lock_config: bool = True):
    """``config_flags.DEFINE_config_file("config", ...)``. With a default file ml_collections applies the
    command line's overrides right here, at import; an override naming no field is then one line, exit 2."""
    from ml_collections import config_flags

    try:
        return config_flags.DEFINE_config_file("config", default, help_text, lock_config=lock_config)
    except (AttributeError, KeyError) as e:
        _unknown_field(sys.argv, e)


class TrainingFlags(NamedTuple):
    config: flags.FlagHolder
    dry_run: flags.FlagHolder
    max_steps: flags.FlagHolder
    print_config: flags.FlagHolder


def define_training_flags(config_help: str, *, step: str, max_steps_help: str) -> TrainingFlags:
    """The flags the training launchers share: ``--config`` (required, locked), ``--dry_run`` (compiles
    ``step`` for the configured mesh), ``--max_steps`` and ``--print_config``."""
    holders = TrainingFlags(
        config=key_flag(define_config(None, config_help, lock_config=True)),
        dry_run=key_flag(flags.DEFINE_bool(
            "dry_run", False, f"Compile the {step} step for the configured mesh, print per-device memory, "
            "exit.")),
        max_steps=key_flag(flags.DEFINE_integer("max_steps", None, max_steps_help)),
        print_config=key_flag(flags.DEFINE_bool("print_config", False, PRINT_CONFIG_HELP)),
    )
    flags.mark_flag_as_required("config")
    return holders


def _interrupt(signum, frame) -> None:
    """SIGINT / SIGTERM outside a training loop: stop at once (exit 130, see ``run``)."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_signals():
    """A fresh ``train.StopSignal`` that SIGINT / SIGTERM trigger while the block runs (the loop given it
    finishes its step, saves a checkpoint and raises ``train.Interrupted``); a second Ctrl-C, or a signal when
    no loop holds the stop, interrupts at once. The previous handlers come back afterwards, so nothing of
    this block reaches a later one."""
    from rstar2jax.train import StopSignal

    stop, asked = StopSignal(), []

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGINT and asked:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        asked.append(signum)
        if not stop.request():  # no training loop running: nothing to finish
            raise KeyboardInterrupt
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
            "(Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _BelowWarning(pylogging.Filter):
    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno < pylogging.WARNING


@contextlib.contextmanager
def console_logging():
    """While the block runs, the library's log records (the ``rstar2jax`` logger) are shown as bare lines,
    INFO on stdout and warnings and errors on stderr, not through absl's handler; as before, when they were
    prints. The logger's level, handlers and propagation come back afterwards."""
    library = pylogging.getLogger("rstar2jax")
    out, err = pylogging.StreamHandler(sys.stdout), pylogging.StreamHandler(sys.stderr)
    out.addFilter(_BelowWarning())
    err.setLevel(pylogging.WARNING)
    for handler in (out, err):
        handler.setFormatter(pylogging.Formatter("%(message)s"))
        library.addHandler(handler)
    saved = library.level, library.propagate
    library.setLevel(pylogging.INFO)
    library.propagate = False
    try:
        yield
    finally:
        library.removeHandler(out)
        library.removeHandler(err)
        library.setLevel(saved[0])
        library.propagate = saved[1]


# --- the persistent compilation cache ---------------------------------------------------------------------


def default_compilation_cache_dir() -> str:
    """Where launchers cache compiled programs unless ``--compilation_cache_dir`` says: JAX's own
    ``$JAX_COMPILATION_CACHE_DIR`` when set, else a per-user folder, ``$XDG_CACHE_HOME/rstar2jax/jax`` (or
    ``~/.cache/rstar2jax/jax``)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "rstar2jax", "jax")


def key_flag(holder: flags.FlagHolder) -> flags.FlagHolder:
    """Lists a flag defined outside the launcher's own module in the launcher's ``--help``."""
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[holder.name])
    return holder


def _define_compilation_cache_flag() -> None:
    """``--compilation_cache_dir``, listed by the calling launcher's ``--help`` (once per process)."""
    if COMPILATION_CACHE_FLAG in flags.FLAGS:
        return
    key_flag(
        flags.DEFINE_string(
            COMPILATION_CACHE_FLAG,
            default_compilation_cache_dir(),
            "Folder of JAX's persistent compilation cache: a later start loads the programs an earlier one "
            "compiled. Default: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/rstar2jax/jax "
            "(~/.cache/rstar2jax/jax). '' turns it off.",
        )
    )


#: Thresholds below which JAX leaves a program out of the cache, lifted so that every program is cached:
#: on a CPU most compile in well under JAX's default second, and together they are a launcher's start-up.
_CACHE_EVERY_PROGRAM = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def enable_compilation_cache(folder: str) -> str | None:
    """Turns JAX's persistent compilation cache on in ``folder`` ('' turns it off) for every program (see
    ``_CACHE_EVERY_PROGRAM``; a threshold set in the environment, as ``JAX_PERSISTENT_CACHE_MIN_...``, is
    kept). Call before anything compiles. Options are set only where this JAX has them (names move
    across versions). Returns the folder, or None when the cache is off."""
    import jax

    def update(name: str, value) -> bool:
        try:
            jax.config.update(name, value)
        except AttributeError:  # "Unrecognized config option": not in this JAX
            return False
        return True

    folder = os.path.abspath(os.path.expanduser(folder)) if folder else ""
    if folder and not update("jax_compilation_cache_dir", folder):
        logging.warning("JAX %s has no jax_compilation_cache_dir: no compilation cache", jax.__version__)
        folder = ""
    update("jax_enable_compilation_cache", bool(folder))
    if folder:
        for name, value in _CACHE_EVERY_PROGRAM.items():
            if name.upper() not in os.environ:
                update(name, value)
    _compilation_cache[:] = [folder or None]
    return folder or None


def compilation_cache_line() -> str:
    """The start line saying where compiled programs are cached (or that they are not)."""
    folder = _compilation_cache[0] if _compilation_cache else None
    if folder is None:
        return "compilation cache: off"
    return f"compilation cache: {folder} (--{COMPILATION_CACHE_FLAG}='' turns it off)"


class StartupClock:
    """Where a launcher's start-up seconds go: phases :meth:`mark`-ed in order since the launcher started,
    and the XLA programs loaded from the persistent compilation cache or compiled meanwhile (counted from
    JAX's monitoring events once :meth:`watch_programs` is called, after JAX is imported)."""

    def __init__(self):
        self._last = _IMPORTED
        self.phases: list[tuple[str, float]] = []
        self.loaded = self.programs = 0
        self._watching = False

    def watch_programs(self) -> None:
        import jax

        self._watching = True

        def on_event(event: str, **_) -> None:
            self.loaded += event == "/jax/compilation_cache/cache_hits"

        def on_duration(event: str, duration: float, **_) -> None:
            self.programs += event == "/jax/core/compile/backend_compile_duration"  # loaded or compiled

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def programs_line(self) -> str:
        compiled = self.programs - self.loaded
        return f"{self.loaded} XLA programs loaded from the compilation cache, {compiled} compiled"

    def line(self) -> str:
        """E.g. ``start-up 7.9 s: imports 2.3 s, weights and tokenizer 1.1 s, engine and programs 3.8 s (7 XLA
        programs loaded from the compilation cache, 0 compiled)``."""
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases)
        programs = f" ({self.programs_line()})" if self._watching else ""
        return f"start-up {self._last - _IMPORTED:.1f} s: {parts}{programs}"


# --- running a launcher ------------------------------------------------------------------------------------


def run(main: Callable[[list[str]], None]) -> None:
    """``absl.app.run(main)``: config errors (at parse time and in ``main``) reported in one line with exit 2,
    interruptions in one line with exit 130, faults that stopped the run in one line with exit 3, a broken
    schedule invariant in one line with exit 1; JAX's
    persistent compilation cache turned on first (``--compilation_cache_dir``, defined here for every
    launcher). The library loads after the flags are parsed, so ``--help`` and flag errors answer at once."""
    _define_compilation_cache_flag()

    def guarded(argv):
        from rstar2jax.agent.outage import SandboxUnavailable
        from rstar2jax.reward import RewardError
        from rstar2jax.train import (
            CheckpointError,
            ConfigError,
            Interrupted,
            RunFault,
            ScheduleInvariantError,
        )

        if logging.get_verbosity() == logging.INFO and not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint file at INFO
        enable_compilation_cache(flags.FLAGS[COMPILATION_CACHE_FLAG].value)
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            with console_logging():
                main(argv)
        except ConfigError as e:
            fail(str(e))
        except (SandboxUnavailable, RunFault, CheckpointError, RewardError) as e:
            fail(str(e), FAULT_EXIT)
        except ScheduleInvariantError as e:
            fail(str(e), INVARIANT_EXIT)
        except Interrupted as e:
            print(
                f"interrupted: checkpoint of step {e.step} saved in {e.checkpoints}; "
                "run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(INTERRUPTED_EXIT)
        except BrokenPipeError:  # output piped into a reader that quit (e.g. `| head`)
            sys.stderr.close()
            sys.exit(0)
        except KeyboardInterrupt:
            where = f"; checkpoints (if any) in {_announced[-1]}" if _announced else ""
            print(f"\ninterrupted{where}", file=sys.stderr, flush=True)
            sys.exit(INTERRUPTED_EXIT)

    app.run(guarded, flags_parser=parse_flags)


# --- what a launcher prints -----------------------------------------------------------------------------


def _leaves(node, prefix: str = ""):
    """(dotted path, value) of every leaf field, in the config's order; lists of configs are indexed."""
    items = node.items() if hasattr(node, "items") else ()
    for key, value in items:
        path = f"{prefix}{key}"
        if hasattr(value, "items") and len(value):
            yield from _leaves(value, path + ".")
        elif isinstance(value, list | tuple) and value and all(hasattr(v, "items") for v in value):
            for index, item in enumerate(value):
                yield from _leaves(item, f"{path}[{index}].")
        else:
            yield path, value


def describe_config(config, extra_help: Mapping[str, str] | None = None) -> list[str]:
    """One line per config field: ``path = value  # meaning``."""
    from rstar2jax.config.field_help import field_help

    rows = [
        (path, repr(value.to_dict() if hasattr(value, "to_dict") else value))
        for path, value in _leaves(config)
    ]
    width = min(max((len(p) + len(v) for p, v in rows), default=0) + 3, 60)
    lines = []
    for path, value in rows:
        meaning = field_help(path, dict(extra_help or {})) or "(no description)"
        lines.append(f"{f'{path} = {value}':<{width}}  # {meaning}")
    return lines


def print_config(config, extra_help: Mapping[str, str] | None = None) -> None:
    print("\n".join(describe_config(config, extra_help)), flush=True)


def demo_config(config, workdir: str | None, print_fields: bool):
    """The demo config (``experiments/configs/demo.py``) with ``--workdir`` applied, or None once
    ``--print_config`` has listed its fields (the demo and the ablation launchers share it)."""
    if workdir:
        config.workdir = workdir
    if not print_fields:
        return config
    from experiments.configs.demo import FIELD_HELP

    print_config(config, FIELD_HELP)
    return None


def announce(title: str, workdir, *, runs: Mapping[str, object] | None = None, options=None) -> None:
    """Prints where a launcher writes: its work folder, then per run (``runs``: name -> run folder; default
    the work folder itself) the checkpoint folder and metrics file, then the TensorBoard command (unless the
    run's ``options`` turn TensorBoard off) and the run's ``notice``."""
    from rstar2jax.train import RunPaths

    workdir = pathlib.Path(workdir).resolve()
    runs = dict(runs or {"": workdir})
    lines = [f"{title}: work folder {workdir}"]
    for name, folder in runs.items():
        paths = RunPaths.of(folder)
        label = f"{name} " if name else ""
        lines += [f"  {label}checkpoints: {paths.checkpoints}", f"  {label}metrics:     {paths.metrics}"]
        _announced.append(paths.checkpoints)
    tensorboard = options is None or options.logging.tensorboard
    if tensorboard:
        logdir = RunPaths.of(workdir).tensorboard if list(runs.values()) == [workdir] else workdir
        missing = "" if shutil.which("tensorboard") else "   (pip install -e '.[tensorboard]')"
        lines.append(f"  tensorboard --logdir {logdir}{missing}")
    else:
        lines.append("  tensorboard: off (config.logging.tensorboard=False)")
    lines.append(f"  {compilation_cache_line()}")
    notice = options.notice if options is not None else ""
    if notice:
        lines.append(f"NOTE: {notice}")
    print("\n".join(lines), flush=True)


def prologue(config, *, kind: str, title: str, dry_run: bool, print_fields: bool):
    """What ``experiments.sft`` and ``train_rl`` do before training: ``--print_config``, or parse the config
    once into the run's typed options (``train.parse``: a bad value is one line and exit 2, before any
    compute), set up this process's devices and compile-and-report (``--dry_run``), or check the rollout's
    precision on this backend (``train.check_rollout_precision``) and announce where the run writes. Returns
    the options when the caller goes on to train, else None."""
    from rstar2jax import train

    if print_fields:
        print_config(config)
        return None
    options = train.parse(config, kind, check_data=not dry_run)
    if not dry_run:
        train.check_wandb(options)  # a missing package: one line, before the processes join
    train.prepare_process(options)
    if dry_run:
        report = train.dry_run(options)
        print(train.format_dry_run(report), flush=True)
        train.check_memory_plan(options, report=report)
        return None
    train.check_mesh(options)  # the mesh against this run's devices (a dry run emulates what it lacks)
    train.check_rollout_precision(options)  # the rollout's precision on this backend (a dry run plans others)
    train.check_memory_plan(options)
    announce(title, options.workdir, options=options)
    return options
