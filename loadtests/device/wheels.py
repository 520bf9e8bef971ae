"""The wheels the GPU machine's image lacks for the GPU check, found by importing the check the way
that image would: in an interpreter that sees only the image's distributions.

    python -m loadtests.device.check --wheels loadtests/out/gpu_wheels

The image (/work/shared/DESIGN.md, "The GPU machine") has Python 3.12 with torch, transformers,
triton, numpy, safetensors, tokenizers, prometheus-client and pytest, and what those require, in
versions older than this venv's; no network. Two rules make the list:

- A distribution the repository's code imports by name at module level (following the check's
  own imports through the repo) travels unless the image names it, with what only it requires:
  an older transformers on the image may not pull it in as this venv's does (pydantic comes here
  through typer), and the engine should run against the versions it was tested with.
- transformers travels although the image has one (`TRACED`): the compiled graphs were traced, and
  their graph breaks checked, under this venv's version; the image's older one may break a graph
  that does not break here. With it goes everything it requires but torch and numpy (the image's
  CUDA builds), at this venv's versions: the image's older tokenizers or huggingface-hub may not
  satisfy it. Installed with `--target` and put first on PYTHONPATH, they shadow the image's.
- Then `loadtests.device.check` is imported with `python -S` (no site-packages), with only the image's
  distributions and those above linked into a scratch directory on the path. An import that fails
  names a missing module: its distribution joins the list and the import is tried again.
  Optional imports (transformers probes many) fail quietly there, as they do on the image.

The list is downloaded as Python 3.12 manylinux wheels, pinned to this venv's versions.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

IMAGE = ("torch", "transformers", "triton", "numpy", "safetensors", "tokenizers", "prometheus-client",
         "pytest")
ENTRY = "loadtests.device.check"  # importing it imports the engine and all the check runs
# Travel although the image has them: the wheels above need newer ones than it may hold
# (pydantic 2.14 imports typing_extensions.Sentinel, new in 4.16).
NEWER_THAN_IMAGE = ("typing-extensions",)
TRACED = ("transformers",)  # travel with their requirements, at this venv's versions
KEEP_IMAGE = ("torch", "numpy", "triton")  # never travel: the image's builds (CUDA) are the ones to run
REPO = Path(__file__).resolve().parents[2]
PIP_PLATFORM = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64")
MISSING = re.compile(r"ModuleNotFoundError: No module named '([^'.]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: Iterable[str], stop: Iterable[str] = ()) -> set[str]:
    """The installed distributions `roots` need, recursively (extras left out), never entering
    the distributions in `stop`."""
    seen: set[str] = set()
    stopped = {canonical(s) for s in stop}
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in stopped:
            continue
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue  # on the image, not here (triton with the CPU build of torch)
        seen.add(name)
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def link(dists: set[str], into: Path) -> None:
    """Symlink every top-level entry (packages, modules, dist-info) of `dists` into `into`."""
    for dist in md.distributions():
        if canonical(dist.metadata["Name"]) not in dists:
            continue
        base = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
            src, dst = base / top, into / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)


def repo_imports(entry: str) -> set[str]:
    """Top-level modules outside the repository that `entry` and the repository modules it
    imports import at module level (`if TYPE_CHECKING:` blocks and function bodies left out)."""
    seen, external, todo = set(), set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = REPO / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = REPO / name.replace(".", "/") / "__init__.py"
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for full in names:
                top = full.partition(".")[0]
                if (REPO / top).is_dir():
                    module = REPO / full.replace(".", "/")
                    if module.with_suffix(".py").exists() or module.is_dir():
                        todo.append(full)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    external.add(top)
    return external


def image_site(entry: str = ENTRY, image: Iterable[str] = IMAGE) -> tuple[list[str], set[str]]:
    """The distributions outside the image that importing `entry` cannot do without, and every
    distribution the image with them has (what `link` puts on a path to run as the image would)."""
    owners = md.packages_distributions()
    named = {canonical(n) for n in image}
    direct = {canonical(d) for top in repo_imports(entry) for d in owners.get(top, [])} - named
    on_image = closure(image, stop=direct)
    wanted = closure(direct)
    traced = closure(TRACED, stop=KEEP_IMAGE)
    needed = sorted(wanted - on_image | {canonical(n) for n in NEWER_THAN_IMAGE} & wanted | traced)
    allowed = on_image | set(needed)
    for _ in range(30):
        with tempfile.TemporaryDirectory() as scratch:
            done = subprocess.run([sys.executable, "-S", "-c", f"import {entry}"], cwd=REPO,
                                  env=image_env(allowed, Path(scratch)), capture_output=True, text=True)
        if done.returncode == 0:
            return needed, allowed
        found = MISSING.search(done.stderr)
        dists = owners.get(found.group(1), []) if found else []
        if not dists:
            raise RuntimeError(f"importing {entry} as on the image failed:\n{done.stderr[-2000:]}")
        new = closure(dists) - allowed
        needed += sorted(new)
        allowed |= new
    raise RuntimeError(f"importing {entry}: more than 30 rounds of missing modules")


def image_env(dists: set[str], scratch: Path) -> dict[str, str]:
    """The environment of a `python -S` that sees `dists` (linked into `scratch`) and the repo."""
    link(dists, scratch)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), str(REPO)])}


def missing(entry: str = ENTRY) -> list[str]:
    return image_site(entry)[0]


def pinned(dists: Iterable[str]) -> list[str]:
    return [f"{d}=={md.version(d)}" for d in dists]


def download_command(dists: Iterable[str], into: str | Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", *PIP_PLATFORM, "-d", str(into),
            *pinned(dists)]


def download(into: str | Path, entry: str = ENTRY) -> list[Path]:
    """Find the missing distributions, download their wheels into `into`; the wheels there."""
    dists = missing(entry)
    command = download_command(dists, into)
    print(" ".join(command[1:]) if dists else f"nothing is missing for {entry}")
    if dists:
        subprocess.run(command, check=True)
    wheels = sorted(Path(into).glob("*.whl"))
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{sum(w.stat().st_size for w in wheels) / 2**20:8.2f} MiB in all (a device call carries 64 MiB)")
    return wheels
