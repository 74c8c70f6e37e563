"""What the wheel installs: the one import root `stepstream`, its data files and py.typed.

Builds the wheel from this checkout (no network: the build uses the running
interpreter's setuptools), then checks its file list and imports the product from it in a
fresh interpreter whose path holds the wheel and nothing of this checkout.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import stepstream

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("engine", "consumers", "producers", "ops", "schemas")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the files git tracks, built in a copy: a build/ folder left in the
    checkout by an earlier build would otherwise leak stale modules into it."""
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        if not (ROOT / name).exists() and not (ROOT / name).is_symlink():
            continue  # deleted in the working tree, not yet committed
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target, follow_symlinks=False)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("stepstream-*.whl")
    return path


def test_the_wheel_installs_one_top_level_name_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"stepstream"}, tops
    assert "stepstream/py.typed" in names
    for sub in SUBPACKAGES:
        assert f"stepstream/{sub}/__init__.py" in names, sub
    assert any(
        n.startswith("stepstream/schemas/stepstream/") and n.endswith(".avsc") for n in names
    )
    assert any(n.startswith("stepstream/ops/api/ui/static/") for n in names)
    # `stepstream broker --apache` resolves its jars from this pom and logs with this config.
    assert "stepstream/ops/brokers/apache-kafka.pom.xml" in names
    assert "stepstream/ops/brokers/apache-log4j2.properties" in names
    assert not any(n.startswith(("examples/", "tests/", "stepstream/examples/")) for n in names)
    (top_level,) = (n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["stepstream"]
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert (
        "stepstream = stepstream.ops.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


def test_the_product_imports_from_the_wheel_alone(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import sys, stepstream, stepstream.ops.cli, stepstream.testing\n"
        "from stepstream.schemas import schema_root\n"
        "assert stepstream.__file__.startswith(sys.argv[1]), stepstream.__file__\n"
        "assert any(schema_root().rglob('*.avsc'))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('engine', 'consumers', 'producers', 'ops', 'schemas', 'examples'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(site)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        # PYTHONPATH comes before the editable install's finder, so this imports the wheel.
        env={"PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_no_module_of_ours_is_imported_under_a_second_top_level_name() -> None:
    """Every product module imports by its `stepstream.` name: a module reached both as
    `engine.x` and `stepstream.engine.x` would run twice with two sets of classes."""
    for info in pkgutil.walk_packages(stepstream.__path__, "stepstream."):
        if ".ui.static" in info.name:
            continue
        importlib.import_module(info.name)
    strays = sorted(m for m in sys.modules if m.split(".")[0] in SUBPACKAGES)
    assert not strays, strays
