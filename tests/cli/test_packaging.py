"""The wheel holds every subpackage and the shipped data, not only what an editable install sees.

The top-level `envs/` and `trainer/` folders are `relax_gym.envs` and `relax_gym.trainer` through pyproject.toml's
package-dir mapping alone: the wheel holds them as real folders inside `relax_gym/`, every module imports from it,
and a wheel built from the sdist (what pip does with one) holds the same files as one built from the tree.
"""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.layout import package_folders, package_modules

ROOT = Path(__file__).resolve().parents[2]


def _clean_build_folder() -> None:
    """setuptools builds a wheel from everything in build/lib, and leaves there what earlier builds copied: a
    module since moved or removed would ship in the next wheel built from this tree."""
    shutil.rmtree(ROOT / "build" / "lib", ignore_errors=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _clean_build_folder()
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=600,
    )
    (found,) = out.glob("relax_gym-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_from_sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _clean_build_folder()
    subprocess.run(  # without --wheel or --sdist, build makes the sdist, then the wheel from it
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=600,
    )
    (found,) = out.glob("relax_gym-*.whl")
    return found


def source_packages() -> set[str]:
    return {name.replace(".", "/") for name, folder in package_folders().items() if (folder / "__init__.py").is_file()}


def test_wheel_contains_every_package_and_the_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("__init__.py")}
    assert source_packages() <= packages
    assert any(n.startswith("relax_gym/envs/data/") for n in names)
    assert "relax_gym/py.typed" in names  # PEP 561: type checkers read the package's own annotations
    assert not any(n.startswith(("envs/", "trainer/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "relax-gym = relax_gym.cli:main" in text
    assert "[relax_gym.envs]" not in text  # `import relax_gym` registers the bundled envs; the group is third parties'


def test_bundled_envs_import_and_load_data_from_the_wheel(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = (
        "import relax_gym, relax_gym.envs, pathlib; "
        f"assert pathlib.Path(relax_gym.__file__).is_relative_to(pathlib.Path(r'{tmp_path}')); "
        "e = relax_gym.make('relax/Math-v0'); obs, _ = e.reset(seed=0); print(len(obs))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 1


def test_every_module_imports_from_the_wheel_alone(wheel, tmp_path):
    """Each module of the source tree, imported from the unpacked wheel (not the tree, not the editable install):
    the layout's mapping put every file where its dotted name says. Modules whose optional dependency is missing
    here may fail only on that dependency's own import."""
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = (
        "import importlib, json, pathlib, sys\n"
        f"names = json.loads({json.dumps(json.dumps(sorted(package_modules())))})\n"
        "failed = {}\n"
        "for name in names:\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        f"        assert pathlib.Path(module.__file__).is_relative_to(r'{tmp_path}'), module.__file__\n"
        "    except ModuleNotFoundError as err:\n"
        "        if (err.name or '').split('.')[0] == 'relax_gym':\n"
        "            failed[name] = repr(err)\n"
        "    except Exception as err:\n"
        "        failed[name] = repr(err)\n"
        "print(json.dumps(failed))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_a_wheel_built_from_the_sdist_holds_the_same_files(wheel, wheel_from_sdist):
    direct, via_sdist = (zipfile.ZipFile(w) for w in (wheel, wheel_from_sdist))
    assert {i.filename: i.file_size for i in via_sdist.infolist() if ".dist-info/" not in i.filename} == {
        i.filename: i.file_size for i in direct.infolist() if ".dist-info/" not in i.filename
    }
