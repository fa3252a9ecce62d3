"""Build arl: the Python package (Triton kernels included, in arl/ops/<op>/), the C++ CPU op
library (csrc/module.cpp + csrc/<op>/*.cpp -> arl._C) and, where torch has CUDA and nvcc exists,
the CUDA op library (csrc/<op>/*.cu + bindings_cuda.cpp -> arl._C_cuda).
Install after torch:  pip install -e . --no-build-isolation
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


# -march=native: arl is always built from source on the machine that runs it
cpu_arch = os.environ.get("ARL_CPU_ARCH", "native")
# -fno-trapping-math: lets GCC if-convert the float compares in the per-token loops, which is what
# vectorizes them (arl never reads floating-point exception flags)
cxx_flags = ["-O3", "-fopenmp", "-std=c++17", "-fno-trapping-math"] + ([f"-march={cpu_arch}"] if cpu_arch else [])
# one folder per op under csrc/; *_cuda.cpp and *.cu go into the CUDA library, other .cpp into arl._C
cpu_sources = rel("csrc/module.cpp") + [p for p in rel("csrc/*/*.cpp") if not p.endswith("_cuda.cpp")]
cuda_sources = rel("csrc/module_cuda.cpp") + rel("csrc/*/*.cu") + rel("csrc/*/*_cuda.cpp")
ext_modules = [
    CppExtension("arl._C", cpu_sources, include_dirs=[os.path.join(ROOT, "csrc")],
                 extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])
]

want_cuda = os.environ.get("ARL_BUILD_CUDA", "auto")
if want_cuda != "0" and torch.version.cuda and shutil.which("nvcc"):
    from torch.utils.cpp_extension import CUDAExtension

    ext_modules.append(
        CUDAExtension(
            "arl._C_cuda",
            cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={
                "cxx": ["-O3"],
                "nvcc": ["-O3", "-lineinfo",
                         "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],
            },
        )
    )

setup(
    name="arl",
    version="0.1.0",
    description="Agentic RL for LLMs with fused chunk-level policy-loss kernels",
    packages=find_packages(include=["arl", "arl.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    extras_require={"wandb": ["wandb==0.31.0"]},  # logging.wandb (arl.config.WANDB_PIN)
    zip_safe=False,
)
