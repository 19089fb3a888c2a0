"""What every launcher shares: flag parsing and error reporting (a bad config value or override exits 2 with
one line naming the field, the value and what is allowed, instead of a traceback).

  from experiments import _launch
  if __name__ == "__main__":
      _launch.run(main)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from absl import app, flags

#: Exit status of a bad config value or command line (absl's own usage errors exit 1).
CONFIG_ERROR_EXIT = 2


def fail(message: str) -> None:
    """Prints ``error: message`` as one line on stderr and exits with ``CONFIG_ERROR_EXIT``."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(CONFIG_ERROR_EXIT)


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
        detail: object = e
        while isinstance(detail, BaseException) and detail.args:  # AttributeError(KeyError("'kep'\nDid..."))
            detail = detail.args[0]
        key, _, hint = str(detail).partition("\n")
        key = key.strip("'\"")
        arg = _override_arg(argv[1:], key)
        fail(f"{arg or 'config override'}: no config field {key!r}{'; ' + hint if hint else ''}")
    return []  # not reached


def run(main: Callable[[list[str]], None]) -> None:
    """``absl.app.run(main)``, config errors (at parse time and in ``main``) reported in one line, exit 2."""
    from rstar2jax.train.config import ConfigError

    def guarded(argv):
        try:
            main(argv)
        except ConfigError as e:
            fail(str(e))

    app.run(guarded, flags_parser=parse_flags)
