"""sandbox_server: a fast, isolated Python execution service (aiohttp front end, forked warm workers).

Standalone: it never imports ``rstar2jax``; clients share only ``sandbox_server.schema``.

    python -m sandbox_server --host 127.0.0.1 --port 8088 --workers 2

    from sandbox_server import start_local
    with start_local(workers=2) as server:
        ...  # POST server.url + "/run" {"code": "print(1 + 1)"}
"""

__all__ = ["LocalServer", "start_local"]


def __getattr__(name: str):
    # Lazy: warm workers import this package, and every module they hold makes each fork dearer
    # (``local`` pulls in urllib, http and email).
    if name in __all__:
        from sandbox_server import local

        return getattr(local, name)
    raise AttributeError(f"module 'sandbox_server' has no attribute {name!r}")
