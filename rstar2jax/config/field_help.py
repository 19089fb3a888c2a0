"""What each run-config field means: the table ``--print_config`` and the config errors read, from the
fields' declarations (``rstar2jax.config.schema``; nothing here imports ml_collections). The help of a field
with a fixed set of values lists exactly those values, generated from the tuple the library checks them
against.
"""

from __future__ import annotations

import re

from rstar2jax.config import schema, schema_rl

#: What each config field means (``--print_config`` lists them). Stage fields are under ``stages.*``, inline
#: model fields under ``model.spec.*``.
FIELD_HELP = {
    **{path: field.help for path, field in {**schema.fields("rl"), **schema.fields("sft")}.items()},
    "model.spec.*": "a ModelConfig field of the inline model",
    **{f"stages.{name}": field.help for name, field in schema_rl.STAGE.items()},
}


def field_help(path: str, extra: dict[str, str] | None = None) -> str | None:
    """The meaning of config field ``path`` (``stages[2].steps`` reads ``stages.steps``), looked up in
    ``extra`` first, then in ``FIELD_HELP`` with leading components dropped until one matches (a demo
    config's ``rl.rl.keep`` is ``rl.keep``); ``a.*`` entries cover every field under ``a``. None when no
    table knows it."""
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    # The options of policy losses registered since this module was imported (a config file's own).
    losses = {name: field.help for name, field in schema_rl.loss_option_fields(FIELD_HELP).items()}
    for table, starts in ((extra or {}, 1), ({**FIELD_HELP, **losses}, len(parts))):
        for start in range(starts):
            if (name := ".".join(parts[start:])) in table:
                return table[name]
            for end in range(len(parts) - 1, start, -1):  # "model.spec.*" covers model.spec.hidden_size
                if (group := ".".join(parts[start:end]) + ".*") in table:
                    return table[group]
    return None
