"""The replay core: one instance's runtime (inputs in, history records out), the
deterministic event loop its code runs on, and the fold of history into state. No I/O."""
