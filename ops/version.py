"""stepstream's version, kept at this path for the code that imports it from here: it
lives in ``engine/version.py`` now, where the client's spans (``producers/``) reach it."""

from stepstream.engine.version import DISTRIBUTION, UNKNOWN, version

__all__ = ["DISTRIBUTION", "UNKNOWN", "version"]
