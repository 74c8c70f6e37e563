"""``python -m stepstream.ops.cli``: the ``stepstream`` command."""

import sys

from stepstream.ops.cli.app import main

# Guarded: walking the package (tests, tools) imports this module without running it.
if __name__ == "__main__":
    sys.exit(main())
