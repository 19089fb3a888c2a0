"""Using a trained policy: load it (:func:`load_policy`: an HF folder or a training run folder) and serve it
behind the OpenAI chat-completions API (:class:`ChatService`, :func:`run_server`, :class:`BackgroundServer`)
on the continuous-batching engine. The launchers are ``experiments/evaluate.py``, ``experiments/chat.py`` and
``experiments/serve.py``; the evaluation they run is :mod:`rstar2jax.eval.evaluate` (the paper's protocol, one
module for every caller) and the chat :mod:`rstar2jax.serve.chat`.

Layering: ``serve`` is the top layer of the library (it imports engine, data, agent, eval and the policy
loader, :mod:`rstar2jax.policy.loader`, never the trainer); nothing in the library imports it. Importing it
starts nothing: names load on use, and serving an HF folder loads no optimizer and no checkpoint library.
"""

import importlib

_NAMES = {
    "rstar2jax.data.conversation": ["PROMPTS", "prompt_format"],
    "rstar2jax.policy.loader": ["Policy", "load_policy"],
    "rstar2jax.serve.protocol": ["ChatRequest", "RequestError", "parse_chat_request"],
    "rstar2jax.serve.server": [
        "BackgroundServer", "ChatService", "ServerConfig", "run_server", "served_format", "start_server",
    ],  # fmt: skip
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_MODULE_OF[name])
    for attr in _NAMES[_MODULE_OF[name]]:
        globals()[attr] = getattr(module, attr)
    return globals()[name]


def __dir__():
    return __all__
