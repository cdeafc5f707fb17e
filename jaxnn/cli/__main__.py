"""`python -m jaxnn.cli ...`, the same as the `jaxnn` command."""

import sys

from jaxnn.cli.main import main

if __name__ == "__main__":  # not when a tool imports every module (API docs, the annotation test)
    sys.exit(main())
