"""The scope names in workflow code get prefixed with: "" at the top, "shipping/" inside
``ctx.scope("shipping")``, ``race/paid/`` inside a race's branch. Tasks created inside a
scope inherit it; a branch or loop iteration sets its own in its own task."""

from __future__ import annotations

from contextvars import ContextVar

current_scope: ContextVar[str] = ContextVar("stepstream_scope", default="")
