"""The `jaxnn` command (also `python -m jaxnn.cli`): `main` parses the flags and runs a subcommand.

- `main.py`: the parser and the one table from an error to an exit status;
- `train.py`: `jaxnn train`'s flags -> a `TrainConfig` (`config.py`); `recipes.py`: that config -> data, model,
  `jaxnn.fit`;
- `runs.py`: `jaxnn export` and `jaxnn generate`; `profile.py`: `jaxnn profile`;
- `multihost.py`: N local `jaxnn train` processes that train one model together (`python -m jaxnn.cli.multihost`).

Importing this package loads no jax, so that device flags can be applied before jax starts.
"""

from jaxnn.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
