"""headroom on the torch people have: the build records the torch it links, the import refuses another
minor release in one line naming both, and pyproject.toml's dependency is the range the build accepts
(CMakeLists.txt), so `pip install --no-build-isolation .` keeps the user's torch."""
import os
import re
import shutil
import subprocess
import sys
import tomllib

import headroom
import torch
from headroom import _torch_check

from conftest import ROOT


def test_the_build_recorded_the_torch_it_runs_with():
    from headroom import _build

    assert _build.TORCH_VERSION == torch.__version__
    assert _torch_check.release(_build.TORCH_VERSION) == _torch_check.release(torch.__version__)


def test_releases_compare_by_major_and_minor():
    assert _torch_check.release("2.15.0+cu130") == (2, 15)
    assert _torch_check.release("2.15.1") == _torch_check.release("2.15.0")
    assert _torch_check.release("2.16.0a0+git1234") == (2, 16)
    assert _torch_check.release("2.13.0") != _torch_check.release("2.15.0")
    assert _torch_check.release("garbage") == (-1, -1)


def _another_release(version: str) -> str:
    major, minor = _torch_check.release(version)
    return f"{major}.{minor - 2 if minor >= 2 else minor + 2}.0"


def test_a_build_for_another_torch_is_refused_at_import_in_one_line(tmp_path):
    # The package as built, its record of the torch rewritten as a build against another release would
    # write it (two minor releases away): importing it must fail before the extension is loaded.
    package = tmp_path / "headroom"
    shutil.copytree(os.path.dirname(headroom.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    other = _another_release(torch.__version__)
    (package / "_build.py").write_text(f'TORCH_VERSION = "{other}"\nTORCH_SUPPORTED = ">=2.11,<2.16"\n')
    done = subprocess.run([sys.executable, "-c", "import headroom"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: headroom was built against torch " + other), done.stderr
    assert f"this Python has torch {torch.__version__}" in last
    assert "--no-build-isolation" in last


def test_the_same_release_with_another_patch_imports(tmp_path):
    package = tmp_path / "headroom"
    shutil.copytree(os.path.dirname(headroom.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    major, minor = _torch_check.release(torch.__version__)
    (package / "_build.py").write_text(f'TORCH_VERSION = "{major}.{minor}.9"\nTORCH_SUPPORTED = ""\n')
    done = subprocess.run([sys.executable, "-c", "import headroom; print(headroom.__file__)"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path))


def test_pyproject_declares_the_range_the_build_accepts():
    from headroom import _build

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    torch_deps = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert torch_deps == ["torch" + _build.TORCH_SUPPORTED]
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    low = re.search(r"set\(HEADROOM_TORCH_MIN ([0-9.]+)\)", cmake).group(1)
    below = re.search(r"set\(HEADROOM_TORCH_BELOW ([0-9.]+)\)", cmake).group(1)
    assert _build.TORCH_SUPPORTED == f">={low},<{below}"
    # The running torch is inside it (this suite is what the range claims).
    release = _torch_check.release(torch.__version__)
    assert tuple(map(int, low.split("."))) <= release < tuple(map(int, below.split(".")))
