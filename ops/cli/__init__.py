"""The ``stepstream`` command line (``stepstream = "stepstream.ops.cli:main"``).

One module per group of commands, each declaring its commands in a ``COMMANDS`` table
(``table.Command``: name, help, arguments, handler): ``run``, ``serve`` (dev, worker),
``instances`` (start, send, cancel, pause, resume, status, result), ``history``,
``listing`` (list), ``tools`` (replay), ``kafka`` (topics), ``bench``. ``options`` has
the options several commands share, ``render`` what they print, ``app`` the table of
them all and ``main``. docs/cli.md is the manual.
"""

from stepstream.ops.cli.app import main

__all__ = ["main"]
