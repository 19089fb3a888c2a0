"""Using a trained policy: load it (:func:`load_policy`: an HF folder or a training run folder) and serve it
behind the OpenAI chat-completions API (:class:`ChatService`, :func:`run_server`) on the continuous-batching
engine. The launchers are ``experiments/evaluate.py``, ``experiments/chat.py`` and ``experiments/serve.py``.

Layering: ``serve`` sits beside ``train`` and ``eval`` (it imports engine, agent, data, eval and the train
runner's model config); nothing in the library imports it.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "policy": ["Policy", "load_policy"],
        "protocol": ["ChatRequest", "RequestError", "parse_chat_request"],
        "server": ["BackgroundServer", "ChatService", "ServerConfig", "run_server", "start_server"],
    },
)
