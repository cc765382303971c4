"""docs/cli.md is what scripts/gen_cli_docs.py writes from the parsers, so a flag added or
changed without regenerating the page fails `make test`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs",
                                                  ROOT / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_docs_are_current():
    expected = _generator().render()
    current = (ROOT / "docs" / "cli.md").read_text()
    assert current == expected, "docs/cli.md is out of date: run python scripts/gen_cli_docs.py"


def test_every_flag_is_documented():
    """The page names every flag the parsers define, engine and server."""
    gen = _generator()
    text = (ROOT / "docs" / "cli.md").read_text()
    for parser in (gen._engine_parser(), gen._server_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in text, flag
