"""Every csrc/<op>/*.cu compiles with nvcc for the arches setup.py builds by default (SASS for each
plus PTX of the newest; raw pointers, no torch headers), so the CUDA kernels are compile-checked on
machines without a GPU or a CUDA torch."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CU_FILES = sorted((ROOT / "csrc").glob("*/*.cu"))
NVCC = shutil.which("nvcc")


def _setup_module():
    spec = importlib.util.spec_from_file_location("arl_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines the flag helpers; setup() runs only as __main__
    return mod


@pytest.mark.slow  # nvcc compiles each .cu file (about a minute)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("src", CU_FILES, ids=[f"{p.parent.name}/{p.name}" for p in CU_FILES])
def test_cu_compiles_for_the_default_arches(src, tmp_path):
    setup = _setup_module()
    gencode = setup.cuda_gencode_flags(setup.nvcc_version(NVCC), env={})
    assert "arch=compute_80,code=sm_80" in gencode and "arch=compute_90,code=sm_90" in gencode
    cmd = [NVCC, "-c", "-std=c++17", "-O3", *gencode, "-I", str(ROOT / "csrc"), str(src),
           "-o", str(tmp_path / (src.stem + ".o"))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"nvcc failed on {src.name}:\n{out.stderr[-4000:]}"
    assert (tmp_path / (src.stem + ".o")).stat().st_size > 0


def test_there_are_cuda_sources():
    assert any(p.parent.name == "policy_loss" and p.name == "cuda.cu" for p in CU_FILES)
