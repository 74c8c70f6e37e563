"""The image the chart runs can be built from this repository, and is the one the chart
names: the Dockerfile (read with dockerfile-parse, as no Docker engine is at hand) builds
the wheel from files the build context really sends (.dockerignore applied as Docker
does, by docker-py's own matcher), installs it on python:3.11-slim, runs `stepstream` as
the user the chart's pods run as, and holds the modules the chart's defaults name. The
build stage is replayed here: its COPYs into a folder, its wheel built from it."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

from tests.helm.chart import CHART, ROOT, container, render

BASE = "python:3.11-slim"


@dataclass
class Stage:
    name: str
    base: str
    copies: list[tuple[dict[str, str], list[str], str]] = field(default_factory=list)
    workdir: str = "/"
    user: str = "root"
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)


def _stages() -> list[Stage]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    stages: list[Stage] = []
    for instruction in parser.structure:
        kind, value = instruction["instruction"], instruction["value"]
        if kind == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name=name, base=words[0]))
        elif kind == "COPY":
            words = shlex.split(value)
            flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            stages[-1].copies.append((flags, paths[:-1], paths[-1]))
        elif kind == "WORKDIR":
            stages[-1].workdir = str(PurePosixPath(stages[-1].workdir) / value)
        elif kind == "USER":
            stages[-1].user = value
        elif kind == "ENV":
            stages[-1].env.update(dict(w.split("=", 1) for w in shlex.split(value)))
        elif kind == "ENTRYPOINT":
            stages[-1].entrypoint = json.loads(value)
    return stages


def _context() -> set[str]:
    """The paths `docker build .` sends, as Docker reads .dockerignore."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return set(exclude_paths(str(ROOT), patterns))


def _sent_files(source: str, context: set[str]) -> list[str]:
    """The files (and symlinks) a COPY of `source` takes from the context."""
    source = source.rstrip("/")
    return sorted(
        path
        for path in context
        if (path == source or path.startswith(source + "/"))
        and ((ROOT / path).is_symlink() or (ROOT / path).is_file())
    )


def test_the_image_is_python_slim_and_runs_the_console_script_as_the_charts_user() -> None:
    stages = _stages()
    assert [stage.base for stage in stages] == [BASE] * len(stages)
    assert len(stages) >= 2, "multi-stage: the wheel is built apart from the runtime"
    final = stages[-1]
    uid, _, gid = final.user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {final.user}: not root, and numeric"
    pod = render().one("StatefulSet")["spec"]["template"]["spec"]["securityContext"]
    # runAsNonRoot can check only a numeric USER.
    assert (int(uid), int(gid)) == (pod["runAsUser"], pod["runAsGroup"])
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert final.entrypoint[0] in scripts
    assert container(render().one("StatefulSet"), "worker")["command"] == final.entrypoint


def test_every_copy_takes_files_the_build_context_sends() -> None:
    context = _context()
    stage_names = {stage.name for stage in _stages()}
    for stage in _stages():
        for flags, sources, _dest in stage.copies:
            if "from" in flags:
                assert flags["from"] in stage_names, f"COPY --from={flags['from']}: no stage"
                continue
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert _sent_files(source, context), f"COPY {source}: .dockerignore leaves it out"
    assert not any(path.startswith((".git/", ".venv/", "tests/")) for path in context)


def _replay_copies(stage: Stage, into: Path, context: set[str]) -> Path:
    """The stage's file system after its COPYs from the context, under `into`."""
    for flags, sources, dest in stage.copies:
        if "from" in flags:
            continue
        target = into / (PurePosixPath(stage.workdir) / dest).relative_to("/")
        for source in sources:
            for path in _sent_files(source, context):
                if (ROOT / source).is_dir():  # a folder's contents land in dest
                    landed = target / PurePosixPath(path).relative_to(source.rstrip("/"))
                elif dest.endswith("/"):
                    landed = target / PurePosixPath(path).name
                else:
                    landed = target
                landed.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / path, landed, follow_symlinks=False)
    return into / stage.workdir.lstrip("/")


def test_the_build_stage_builds_the_wheel_with_the_console_script(tmp_path: Path) -> None:
    build = _stages()[0]
    (run,) = [
        i["value"]
        for i in DockerfileParser(path=str(ROOT / "Dockerfile")).structure
        if i["instruction"] == "RUN" and "pip wheel" in i["value"]
    ][:1]
    assert run.split()[-1] == ".", run
    workdir = _replay_copies(build, tmp_path / "fs", _context())
    out = tmp_path / "dist"
    # Docker's build downloads setuptools; here the running interpreter's serves, offline.
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    built = subprocess.run(
        [*pip, "-w", str(out), str(workdir)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("stepstream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "stepstream/ops/cli/__init__.py" in names and "stepstream/engine/__init__.py" in names
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert re.search(r"^stepstream = stepstream\.ops\.cli:main$", text, re.MULTILINE), text


def test_the_image_holds_the_modules_the_charts_defaults_run(tmp_path: Path) -> None:
    final = _stages()[-1]
    root = tmp_path / "fs"
    _replay_copies(final, root, _context())
    python_path = [root / p.lstrip("/") for p in final.env["PYTHONPATH"].split(":")]
    worker = container(render().one("StatefulSet"), "worker")
    modules = worker["args"][worker["args"].index("--workflows") + 1].split(",")
    for module in modules:
        relative = Path(*module.split("."))
        assert any(
            (p / relative).with_suffix(".py").is_file() or (p / relative / "__init__.py").is_file()
            for p in python_path
        ), f"workers.workflows names {module}, which the image does not hold"


def test_the_default_image_is_the_one_the_docs_say_to_build() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version, "the image's tag is the chart's appVersion"
    image = container(render().one("StatefulSet"), "worker")["image"]
    guide = (ROOT / "docs" / "operations.md").read_text()
    built = re.search(r"^docker build -t (\S+) \.$", guide, re.MULTILINE)
    assert built, "docs/operations.md lost its docker build command"
    assert built.group(1) == image == f"ghcr.io/stepstream/stepstream:{version}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"docker build -t {image} ." in dockerfile
