"""The workflow API: what workflow code calls (``ctx``, ``@workflow``, loops, sagas,
messages, the outbox, sources, hooks, retry policies). A thin facade over the replay
core, reached through the ``WorkflowRuntime`` protocol in ``runtime``."""
