"""How an option type says which config key each of its fields is read from: ``key("mesh.fsdp")`` on the
field, stated where the field is declared, so renaming a field or a key is an error the parser reports
(a key no option reads, ``parse``'s last check) rather than a silent rebinding by a matching name."""

from __future__ import annotations

import dataclasses
from typing import Any

_CONFIG_KEY = "config_key"


def key(path: str, **field_options) -> Any:
    """A dataclass field read from the config key ``path`` (``"optimizer.learning_rate"``; a stage's fields:
    the key inside ``config.stages[i]``); ``field_options``: ``dataclasses.field``'s (``default``, ...)."""
    return dataclasses.field(metadata={_CONFIG_KEY: path}, **field_options)


def config_keys(cls) -> dict[str, str]:
    """``cls``'s fields that are read from the config: field name -> config key. Fields without a
    :func:`key` are built by the parser from other fields (derived lengths, per-stage values)."""
    return {f.name: f.metadata[_CONFIG_KEY] for f in dataclasses.fields(cls) if _CONFIG_KEY in f.metadata}
