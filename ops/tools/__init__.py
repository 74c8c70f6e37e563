"""Tools over recorded histories, for the CLI, the web UI and ``stepstream.testing``.

- ``history_export``: the history export file (write one instance's records, read them
  back)
- ``timeline``: one instance's history as timeline rows and the CLI's text of them
- ``replay``: today's workflow code against recorded histories, with no side effects
"""
