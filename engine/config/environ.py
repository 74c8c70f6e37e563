"""``STEPSTREAM_*`` environment variables read as typed config values, with errors that
name the variable and what it should hold."""

from __future__ import annotations

import math
from collections.abc import Mapping

from stepstream.engine.errors import StepstreamError


class ConfigError(StepstreamError):
    """A configuration value (flag or environment variable) is not usable."""


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number; set it to an integer such as {default} "
            "(no units) or unset it"
        ) from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


def env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip().removesuffix("s"))
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number of seconds; set it to e.g. {default:g} or unset it"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}={raw!r} must be a finite number of seconds, not negative")
    return value
