"""What every launcher shares (``experiments.sft``, ``train_rl``, ``demo``, ``ablate_roc``; ``evaluate``,
``chat`` and ``serve`` load their policy with :func:`load_policy`):

- flag parsing and errors: a bad config value, override or flag exits 2 with one line naming the field, the
  value and what is allowed, never a traceback;
- ``--print_config``: every config field with its value and meaning;
- at start, where the run writes: work folder, checkpoint folder, metrics file, the ``tensorboard --logdir``
  line (and the config's ``notice``, e.g. that it is a smoke test);
- Ctrl-C: the training loop finishes its step, saves a checkpoint and the launcher exits (status 130) with
  one line saying where; a second Ctrl-C stops at once. SIGTERM (a scheduler's preemption) does the same as
  the first Ctrl-C.

  from experiments import _launch
  if __name__ == "__main__":
      _launch.run(main)
"""

from __future__ import annotations

import pathlib
import re
import shutil
import signal
import sys
from collections.abc import Callable, Mapping

from absl import app, flags, logging

#: Exit status of a bad config value or command line (absl's own usage errors exit 1).
CONFIG_ERROR_EXIT = 2
#: Exit status after an interruption (128 + SIGINT, as a shell reports it).
INTERRUPTED_EXIT = 130
PRINT_CONFIG_HELP = "List every config field (after overrides) with its value and meaning, then exit."

_announced: list[pathlib.Path] = []  # checkpoint folders of this invocation, for the interruption line


def fail(message: str) -> None:
    """Prints ``error: message`` as one line on stderr and exits with ``CONFIG_ERROR_EXIT``."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(CONFIG_ERROR_EXIT)


#: The ``--adapter`` flag of evaluate / chat / serve.
ADAPTER_HELP = "PEFT LoRA adapter folder merged into --model (then an HF base folder or hub name)."


def load_policy(model: str, *, tokenizer: str | None, dtype: str, adapter: str | None):
    """``rstar2jax.serve.load_policy`` for evaluate / chat / serve: a model or adapter that cannot be loaded
    (a missing folder, an adapter for another base) is one line and exit 2."""
    from rstar2jax.serve import load_policy as load

    try:
        return load(model, tokenizer=tokenizer, dtype=dtype, adapter=adapter)
    except (FileNotFoundError, ValueError) as error:
        fail(str(error))


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
        fail(f"{e} (--help lists the flags, --print_config the config fields)")
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
    fail(f"{arg or 'config override'}: no config field {key!r}{'; ' + hint if hint else ''}")


def define_config(default: str | None, help_text: str, *, lock_config: bool = True):
    """``config_flags.DEFINE_config_file("config", ...)``. With a default file ml_collections applies the
    command line's overrides right here, at import; an override naming no field is then one line, exit 2."""
    from ml_collections import config_flags

    try:
        return config_flags.DEFINE_config_file("config", default, help_text, lock_config=lock_config)
    except (AttributeError, KeyError) as e:
        _unknown_field(sys.argv, e)


def _on_signal(signum, frame) -> None:
    from rstar2jax import train

    name = signal.Signals(signum).name
    if signum == signal.SIGINT and getattr(_on_signal, "asked", False):
        raise KeyboardInterrupt  # the second Ctrl-C: stop now
    _on_signal.asked = True
    if not train.request_stop():  # no training loop running: nothing to finish
        raise KeyboardInterrupt
    print(
        f"\n{name}: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)",
        file=sys.stderr,
        flush=True,
    )


def run(main: Callable[[list[str]], None]) -> None:
    """``absl.app.run(main)``: config errors (at parse time and in ``main``) reported in one line with exit 2,
    interruptions in one line with exit 130."""
    from rstar2jax.train import ConfigError, Interrupted

    def guarded(argv):
        if logging.get_verbosity() == logging.INFO and not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint file at INFO
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)
        try:
            main(argv)
        except ConfigError as e:
            fail(str(e))
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
    from rstar2jax.train.config import field_help

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


def announce(title: str, workdir, *, runs: Mapping[str, object] | None = None, config=None) -> None:
    """Prints where a launcher writes: its work folder, then per run (``runs``: name -> run folder; default
    the work folder itself) the checkpoint folder and metrics file, then the TensorBoard command and the
    config's ``notice``."""
    from rstar2jax.train import RunPaths

    workdir = pathlib.Path(workdir).resolve()
    runs = dict(runs or {"": workdir})
    lines = [f"{title}: work folder {workdir}"]
    for name, folder in runs.items():
        paths = RunPaths.of(folder)
        label = f"{name} " if name else ""
        lines += [f"  {label}checkpoints: {paths.checkpoints}", f"  {label}metrics:     {paths.metrics}"]
        _announced.append(paths.checkpoints)
    tensorboard = config is None or config.logging.tensorboard
    if tensorboard:
        logdir = RunPaths.of(workdir).tensorboard if list(runs.values()) == [workdir] else workdir
        missing = "" if shutil.which("tensorboard") else "   (pip install -e '.[tensorboard]')"
        lines.append(f"  tensorboard --logdir {logdir}{missing}")
    else:
        lines.append("  tensorboard: off (config.logging.tensorboard=False)")
    notice = config.get("notice", "") if config is not None else ""
    if notice:
        lines.append(f"NOTE: {notice}")
    print("\n".join(lines), flush=True)


def prologue(config, *, kind: str, title: str, dry_run: bool, print_fields: bool) -> bool:
    """What ``experiments.sft`` and ``train_rl`` do before training: ``--print_config``, or validate the
    config before any compute (one line and exit 2 on a bad value), set up this process's devices and
    compile-and-report (``--dry_run``), or announce where the run writes. True when the caller goes on to
    train."""
    from rstar2jax import train

    if print_fields:
        print_config(config)
        return False
    train.validate(config, kind, check_data=not dry_run)
    train.prepare_process(config)
    if dry_run:
        report = train.dry_run(config, kind=kind)
        print(train.format_dry_run(report), flush=True)
        train.check_memory_plan(config, kind=kind, report=report)
        return False
    train.check_memory_plan(config, kind=kind)
    announce(title, config.workdir, config=config)
    return True
