"""Where the training script finds things in the repository, and the package's pure-Python
modules it uses, loaded straight from their files: the demo data and preamble (``colibri/demo``,
loaded as a package of its own) and the chat template, so neither the compiled engine nor an
installed colibri is needed."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "python" / "colibri"
TEMPLATE_PATH = PKG / "chat" / "templates" / "glm45.jinja"
SHIP_DIR = PKG / "demo" / "model"
COLIBRI = ROOT / ".venv" / "bin" / "colibri"
VENV_PY = ROOT / ".venv" / "bin" / "python"


def _load(name: str, path: Path):
    """Imports one pure-Python module of the package from its file (no package __init__)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_package(name: str, directory: Path):
    """Imports a directory of the package as a package of its own named ``name`` (its modules
    import each other relatively), without the package above it."""
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_load_package("colibri_demo", PKG / "demo")
demo_data = importlib.import_module("colibri_demo.data")
demo_preamble = importlib.import_module("colibri_demo.preamble")
chat_template = _load("colibri_chat_template", PKG / "chat" / "template.py")
