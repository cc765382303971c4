"""Flags of ``pagedserve serve`` that concern HTTP, not the engine."""

from __future__ import annotations

import argparse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback only; 0.0.0.0 exposes the server)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    g.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="reject request bodies larger than this with 413")
    g.add_argument("--log-level", default="info")
