"""The packaging: an editable install of a checkout works from the folder that holds it.

A checkout's folder bears the project's name (`git clone .../pycalm` makes pycalm/pycalm/), so
Python started from its parent sees a folder `pycalm` on its path before anything else. The
editable install must put the package itself on the path (setup.cfg: package_dir), where it wins
over that namespace folder; an import hook, asked only after the path search, would lose to it.
The install here is a real `pip install -e` of the repository's own setup.cfg and pyproject.toml
into a bare virtual environment, offline (no build isolation). The build backend is this
environment's setuptools and wheel (the test extras), put on the build's path: the nested
environment's base Python may have none (3.12 and later ship no setuptools) or one that cannot
build an editable wheel (3.10 and 3.11 ship setuptools 65 without wheel: "invalid command
'bdist_wheel'").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import setuptools
import wheel

import pycalm

REPO = Path(__file__).resolve().parent.parent


def test_import_from_the_folder_holding_the_checkout(tmp_path):
    checkout = tmp_path / "pycalm"
    (checkout / "pycalm").mkdir(parents=True)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copyfile(REPO / name, checkout / name)
    shutil.copyfile(REPO / "pycalm" / "__init__.py", checkout / "pycalm" / "__init__.py")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    backend = {str(Path(m.__file__).resolve().parent.parent) for m in (setuptools, wheel)}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index"]
        + ["--no-build-isolation", "-e", checkout],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join(sorted(backend))},
    )
    assert install.returncode == 0, install.stderr
    probe = "import pycalm; print(pycalm.__version__, pycalm.__file__)"
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [pycalm.__version__, str(checkout / "pycalm" / "__init__.py")]
