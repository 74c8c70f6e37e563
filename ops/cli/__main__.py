"""``python -m stepstream.ops.cli``: the ``stepstream`` command."""

import sys

from stepstream.ops.cli.app import main

sys.exit(main())
