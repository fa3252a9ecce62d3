"""PEP 517 build backend for arl: setuptools, plus torch in the isolated build environment at the
version the target environment already has (the C++/CUDA ops link against torch's C++ ABI, which
changes between releases, so they must be compiled against the torch they will load into). With no
torch in the target yet, the tested CPU release; install torch first to build against another.
A torch that no index carries (a source build): pip install --no-build-isolation ."""
import os
import sys
import sysconfig
from importlib import metadata

from setuptools.build_meta import *  # noqa: F401,F403  every other hook is setuptools'

DEFAULT_TORCH = "torch==2.13.0"  # install.sh's CPU pin


def _target_site_dirs() -> list[str]:
    """The target interpreter's site-packages (pip hides them from the build process's sys.path,
    not from sysconfig), and the base interpreter's when a venv includes system site-packages."""
    dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    if sys.prefix != sys.base_prefix and os.path.exists(cfg):
        with open(cfg) as f:
            inherit = any(line.replace(" ", "").lower() == "include-system-site-packages=true\n" for line in f)
        if inherit:
            base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
            dirs += [sysconfig.get_paths(vars=base)[k] for k in ("purelib", "platlib")]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def torch_requirement() -> str:
    for dist in metadata.distributions(name="torch", path=_target_site_dirs()):
        return f"torch=={dist.version}"
    return DEFAULT_TORCH


def get_requires_for_build_wheel(config_settings=None):
    # setuptools' own hook would run setup.py, which imports torch before it is installed
    return [torch_requirement()]


def get_requires_for_build_editable(config_settings=None):
    return [torch_requirement()]


def get_requires_for_build_sdist(config_settings=None):
    return [torch_requirement()]

