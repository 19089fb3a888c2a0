"""``python -m sandbox_server``: start the sandbox service (see ``--help`` for every limit)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

from sandbox_server.app import serve
from sandbox_server.config import ServerConfig, build_arg_parser


def main(argv=None) -> None:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(ServerConfig)}
    values["token"] = values["token"] or os.environ.get("SANDBOX_TOKEN") or None
    try:
        config = ServerConfig(**values)
    except ValueError as error:
        parser.error(str(error))
    if not config.loopback and not config.token and not args.insecure_no_token:
        parser.error(f"binding {config.host} needs --token (or SANDBOX_TOKEN), or --insecure-no-token")
    asyncio.run(serve(config, stop_at_stdin_eof=args.stop_at_stdin_eof))


if __name__ == "__main__":
    main()
