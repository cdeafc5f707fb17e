"""`python -m jaxnn.cli ...`, the same as the `jaxnn` command."""

import sys

from jaxnn.cli.main import main

sys.exit(main())
