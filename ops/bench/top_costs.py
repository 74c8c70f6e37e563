"""``python -m stepstream.ops.bench.top_costs FILE``: where a ``stepstream bench --profile`` file
spent its samples, as shares: self time (the function itself) and inclusive time (it and
what it called), by default of the event-loop threads only (the loop is what a busy
engine runs out of). The figures in docs/performance.md were read this way.
"""

from __future__ import annotations


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (file path from the package root)``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("/site-packages/", "/lib/python3.", "/stepstream/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    for root in ("engine/", "consumers/", "producers/", "ops/"):
        if f"/{root}" in path:
            path = root + path.split(f"/{root}", 1)[1]
    return f"{name} ({path})"


def _runs_loop(name: str) -> bool:
    # asyncio's own loop shows run_forever; uvloop's runs it in C, so the frame above
    # it is asyncio.Runner.run (or run_until_complete).
    return name.startswith(("run_forever ", "Runner.run ", "run_until_complete "))


def top_costs(path: str, *, loop_only: bool = True, top: int = 25) -> str:
    """The functions a collapsed-stack profile spent its samples in: self time (the
    function itself) and inclusive time (it and what it called), as shares of the
    samples; ``loop_only`` keeps the threads that run the asyncio loop."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [f for f in stack.split(";") if not f.startswith(("thread ", "process "))]
            names = [_frame_name(f) for f in frames]
            if not names or (loop_only and not any(_runs_loop(n) for n in names)):
                continue
            total += int(count)
            own[names[-1]] = own.get(names[-1], 0) + int(count)
            for name in set(names):
                inclusive[name] = inclusive.get(name, 0) + int(count)
    out = [f"{path}: {total} samples{' (event-loop threads)' if loop_only else ''}"]
    for title, counts in (("self", own), ("inclusive", inclusive)):
        out.append(f"-- {title}")
        ranked = sorted(counts.items(), key=lambda item: -item[1])[:top]
        out += [f"{100 * c / max(total, 1):5.1f}% {name}" for name, c in ranked]
    return "\n".join(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m stepstream.ops.bench.top_costs",
        description="the top costs of a `stepstream bench --profile` file",
    )
    parser.add_argument("file")
    parser.add_argument("--all-threads", action="store_true", help="not only the loop's")
    parser.add_argument("--top", type=int, default=25)
    options = parser.parse_args()
    print(top_costs(options.file, loop_only=not options.all_threads, top=options.top))
