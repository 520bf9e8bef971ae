"""The README cannot drift from the code: its module map names every module of the product and
every part of loadtests/ and nothing that is gone; each default in its settings table is the
code's and each serve_config.yaml value the file's; the versions it pins are those `make install`
installs; it carries no run tables, dates or commit hashes (those live in docs/results/); its
links resolve; and the product imports no tooling."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from app.settings_doc import rows

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PRODUCT = ("app", "autoscale", "replicas")
SETTINGS_HEADER = "| setting | default | `serve_config.yaml` | what |"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def module_map() -> dict[str, dict[str, str]]:
    """{folder: {entry: description}} from the map's code block; a subpackage's entries are
    indented under it and listed under its own folder ("replicas/execution")."""
    block = section("The module map").split("```")[1]
    tree: dict[str, dict[str, str]] = {}
    folders: list[str] = []  # the folder at each depth of indentation
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        entry, _, description = line.strip().partition(" ")
        assert description.strip(), f"the module map's line for {entry} says nothing"
        depth = (len(line) - len(line.lstrip())) // 2
        assert depth <= len(folders), f"the module map's line for {entry} is indented too deep"
        del folders[depth:]
        if depth:
            tree[folders[-1]][entry] = description.strip()
        if depth == 0 or entry.endswith("/"):
            folder = entry.rstrip("/") if depth == 0 else f"{folders[-1]}/{entry.rstrip('/')}"
            tree.setdefault(folder, {})
            folders.append(folder)
    return tree


def parts(folder: Path) -> set[str]:
    """A folder's modules (`x.py`) and packages (`x/`), as the map writes them."""
    modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    return modules | {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").exists()}


def test_the_module_map_names_every_product_module_and_nothing_gone() -> None:
    tree = module_map()
    packages = [p for p in tree if p.split("/")[0] in PRODUCT]
    assert "replicas/execution" in packages  # subpackages are read, and checked like the rest
    for package in packages:
        listed, present = set(tree[package]), parts(REPO / package)
        assert listed - present == set(), f"the README's map lists what {package}/ no longer has"
        assert present - listed == set(), f"the README's map omits modules of {package}/"
    for package in PRODUCT:  # every subpackage on disk is mapped too
        for sub in (REPO / package).rglob("__init__.py"):
            assert str(sub.parent.relative_to(REPO)) in tree, f"the README's map omits {sub.parent}"


def test_the_module_map_names_every_part_of_loadtests() -> None:
    tree = module_map()
    packages = {p for p in parts(REPO / "loadtests") if p.endswith("/")}
    assert set(tree["loadtests"]) == packages
    assert all((REPO / "tests" / entry).exists() for entry in tree["tests"])


def table_lines(lines: list[str]) -> list[str]:
    """The lines of the table that starts `lines`."""
    out = []
    for line in lines:
        if not line.startswith("|"):
            break
        out.append(line)
    return out


def first_code(cell: str) -> str:
    """The cell's first `code` span: the value it states (what follows only explains it)."""
    match = re.search(r"`([^`]*)`", cell)
    assert match, f"no value in {cell!r}"
    return match.group(1)


def yaml_args() -> dict:
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    return config["applications"][0]["args"]


def lookup(args: dict, dotted: str) -> object:
    """The value serve_config.yaml sets for `engine.policy`-style names, or KeyError."""
    value: object = args
    for key in dotted.split("."):
        value = value[key]  # type: ignore[index]
    return value


def test_the_settings_table_states_the_codes_defaults_and_the_files_values() -> None:
    defaults = {name: default.strip("`") for name, default, _ in rows()}
    lines = table_lines(section("Settings a user changes first").split(SETTINGS_HEADER)[1].splitlines()[2:])
    assert len(lines) >= 5, "the settings table is gone"
    args = yaml_args()
    for line in lines:
        name_cell, default_cell, file_cell, what = (cell.strip() for cell in line.strip().strip("|").split("|"))
        name = first_code(name_cell)
        assert name in defaults, f"the README's settings table names {name}, which is not a setting"
        assert first_code(default_cell) == defaults[name], f"{name}: the code's default is {defaults[name]}"
        if file_cell == "-":
            with pytest.raises(KeyError):
                lookup(args, name)
        else:
            assert json.loads(first_code(file_cell)) == lookup(args, name), f"{name}: serve_config.yaml differs"
        assert what


def test_no_run_tables_dates_or_commits_in_the_readme() -> None:
    text = README.read_text()
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "dates go to docs/results/"
    # A short hash (7 hex digits, even all decimal), or a longer run of hex mixing letters and digits.
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
              if len(w) == 7 or (re.search(r"[a-f]", w) and re.search(r"\d", w))]
    assert not hashes, f"commit hashes go to docs/results/: {hashes}"
    assert table_headers(text) == [SETTINGS_HEADER], "run tables go to docs/results/"


def table_headers(text: str) -> list[str]:
    """Every Markdown table's header line (the line above a |---| rule)."""
    lines = text.splitlines()
    return [lines[i].strip() for i in range(len(lines) - 1)
            if lines[i].lstrip().startswith("|") and re.fullmatch(r"\s*\|[-:| ]+\|\s*", lines[i + 1])]


def test_the_pins_the_readme_names_are_the_ones_make_installs() -> None:
    from replicas.loading.model_files import wheel_requirements

    pins = set(re.findall(r"[\w.-]+==[\w.]+", README.read_text()))
    cpu_torch = re.findall(r"^CPU_TORCH \?= (\S+)", (REPO / "Makefile").read_text(), re.M)
    assert pins and pins == set(wheel_requirements()) | set(cpu_torch)


def test_the_readmes_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links {target}, which is not there"


def test_the_product_imports_no_tooling() -> None:
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                tops = {name.partition(".")[0] for name in names}
                assert not tops & {"loadtests", "tests"}, f"{path.relative_to(REPO)} imports {tops}"
