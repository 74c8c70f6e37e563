"""How fast ``list_page(where=...)`` is with many instances: not a test, a measurement.

    python -m tests.attributes_scale --n 100000 [--data DIR]

Makes ``--n`` instances of ``tagged`` (``tests.workflows``) through the embedded engine,
unless ``--data`` already holds them, each with attributes ``customer`` (one of 1,000
values, as text), ``tier`` ("gold" for one in ten) and ``amount`` (a float), then times
``Client.list_page`` with each filter, in each order: the median of a few runs, in ms.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client

RUNS = 5
FILTERS: dict[str, dict[str, Any]] = {
    "none": {},
    "customer (0.1 %, text)": {"customer": "42"},
    "tier (10 %, text)": {"tier": "gold"},
    "amount (0.2 %, number)": {"amount": 25.0},
    "no match": {"customer": "nobody"},
}


def _attributes(i: int) -> dict[str, Any]:
    return {
        "customer": str(i % 1000),
        "tier": "gold" if i % 10 == 0 else "basic",
        "amount": float(i % 500),
    }


async def measure(data: Path, n: int) -> dict[str, Any]:
    registry = Registry()
    registry.add_module("tests.workflows")
    fresh = not data.exists()
    engine = await open_embedded(registry, EmbeddedConfig(data_dir=str(data), partitions=4))
    out: dict[str, Any] = {"instances": n}
    async with Client(engine.make_transport(owns_engine=True)) as client:
        if fresh:
            started = time.perf_counter()
            for low in range(0, n, 500):
                await asyncio.gather(
                    *(
                        client.start("tagged", _attributes(i), instance_id=f"t-{i:06d}")
                        for i in range(low, min(n, low + 500))
                    )
                )
            out["make_s"] = round(time.perf_counter() - started, 1)
            while (await client.list_page(status="pending", limit=1, order="id")).instances:
                await asyncio.sleep(0.5)
        for order in ("newest", "id"):
            for name, where in FILTERS.items():
                times = []
                for _ in range(RUNS):
                    started = time.perf_counter()
                    page = await client.list_page(where=where, order=order, limit=50)
                    times.append((time.perf_counter() - started) * 1000)
                out[f"{order}: {name}"] = {
                    "ms": round(statistics.median(times), 1),
                    "rows": len(page.instances),
                }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--data", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data = args.data or Path(scratch) / "data"
        print(json.dumps(asyncio.run(measure(data, args.n)), indent=1))


if __name__ == "__main__":
    main()
