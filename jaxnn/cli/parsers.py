"""The one way a `jaxnn` subcommand's parser is made, so that every command's `--help` reads alike (its defaults
shown beside each flag) and every one reports bad flags through `jaxnn.cli.main`'s one-line error."""

from __future__ import annotations

import argparse
from typing import Any


def add_command(sub: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand `name` of the `jaxnn` parser's subparsers `sub`: `help` is its line in `jaxnn --help`,
    `description` the text above its own flags."""
    return sub.add_parser(
        name, help=help, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
