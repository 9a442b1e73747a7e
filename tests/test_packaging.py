"""The wheel carries every subpackage and the built-in problem (pyproject lists them by hand)."""

from __future__ import annotations

import tomllib

from conftest import ROOT

ROOTS = {"core": "optpipe.core", "solvers": "optpipe.solvers", "plan": "optpipe.plan", "runtime": "optpipe.runtime",
         "cli": "optpipe.cli"}


def test_every_code_or_data_folder_is_a_declared_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {package: folder for folder, package in ROOTS.items()}
    declared = set(config["packages"])
    on_disk = set()
    for folder, package in ROOTS.items():
        for path in [ROOT / folder, *(ROOT / folder).rglob("*")]:
            if path.is_dir() and path.name != "__pycache__" and any(
                    f.is_file() and f.suffix in (".py", ".toml") for f in path.iterdir()):
                on_disk.add(".".join([package, *path.relative_to(ROOT / folder).parts]))
    assert on_disk == declared, f"add to [tool.setuptools] packages: {sorted(on_disk - declared)}; " \
                                f"remove: {sorted(declared - on_disk)}"
    assert config["package-data"] == {"optpipe.core.data": ["*.toml"]}
