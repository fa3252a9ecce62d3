"""Build arl's compiled ops (metadata and dependencies are in pyproject.toml): the C++ CPU op library
(csrc/module.cpp + csrc/<op>/*.cpp -> arl._C) and, where torch has CUDA and nvcc exists, the CUDA
op library (csrc/<op>/*.cu + bindings_cuda.cpp -> arl._C_cuda).
In place, after torch:  python setup.py build_ext --inplace   (what install.sh runs)

Build knobs (environment):
  ARL_CPU_ARCH          -march for the C++ op.  Unset: x86-64-v3 (AVX2/FMA: Intel Haswell, AMD Zen
                        and newer), or the compiler's baseline where the build machine lacks those
                        features or is not x86-64.  "native": the build machine's own CPU (fastest;
                        the library may then crash with SIGILL on another CPU).  "": no -march.
  ARL_BUILD_CUDA=0      skip the CUDA library.
  TORCH_CUDA_ARCH_LIST  torch's own list (e.g. "9.0;12.0+PTX"), replacing arl's default arches.
"""
import glob
import os
import platform
import re
import shutil
import subprocess

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# what x86-64-v3 adds over the baseline, as /proc/cpuinfo names it (abm is LZCNT)
X86_64_V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
CUDA_ARCHES = ("80", "90")  # A100, H100/H200
CUDA_ARCHES_12_8 = ("100", "120")  # B200, RTX 50xx: nvcc 12.8 and newer


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def host_cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def compiler_accepts(flag):
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, flag, "-x", "c++", "-E", "-o", os.devnull, os.devnull],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cpu_arch_flags(env=os.environ, machine=None, cpu_flags=None, accepts=compiler_accepts):
    """The -march flag for the C++ op: portable by default (see the module docstring)."""
    if "ARL_CPU_ARCH" in env:
        arch = env["ARL_CPU_ARCH"].strip()
        return [f"-march={arch}"] if arch else []
    machine = machine or platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return []
    cpu_flags = host_cpu_flags() if cpu_flags is None else cpu_flags
    if X86_64_V3_FLAGS <= cpu_flags and accepts("-march=x86-64-v3"):
        return ["-march=x86-64-v3"]
    return []  # the compiler's baseline x86-64: runs anywhere


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def cuda_gencode_flags(version, env=os.environ):
    """SASS for each default arch plus PTX of the newest, which the driver JIT-compiles on GPUs newer
    than any listed. With TORCH_CUDA_ARCH_LIST set, nothing: torch derives the flags from it."""
    if env.get("TORCH_CUDA_ARCH_LIST"):
        return []
    arches = CUDA_ARCHES + (CUDA_ARCHES_12_8 if version >= (12, 8) else ())
    flags = []
    for a in arches:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags + ["-gencode", f"arch=compute_{arches[-1]},code=compute_{arches[-1]}"]


def ext_modules():
    import torch
    from torch.utils.cpp_extension import CppExtension

    # -fno-trapping-math: lets GCC if-convert the float compares in the per-token loops, which is
    # what vectorizes them (arl never reads floating-point exception flags)
    cxx_flags = ["-O3", "-fopenmp", "-std=c++17", "-fno-trapping-math"] + cpu_arch_flags()
    # one folder per op under csrc/; *_cuda.cpp and *.cu go into the CUDA library, other .cpp into arl._C
    cpu_sources = rel("csrc/module.cpp") + [p for p in rel("csrc/*/*.cpp") if not p.endswith("_cuda.cpp")]
    cuda_sources = rel("csrc/module_cuda.cpp") + rel("csrc/*/*.cu") + rel("csrc/*/*_cuda.cpp")
    mods = [CppExtension("arl._C", cpu_sources, include_dirs=[os.path.join(ROOT, "csrc")],
                         extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])]
    nvcc = shutil.which("nvcc")
    if os.environ.get("ARL_BUILD_CUDA", "auto") != "0" and torch.version.cuda and nvcc:
        from torch.utils.cpp_extension import CUDAExtension

        mods.append(CUDAExtension(
            "arl._C_cuda", cuda_sources, include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": ["-O3"],
                                "nvcc": ["-O3", "-lineinfo"] + cuda_gencode_flags(nvcc_version(nvcc))}))
    return mods


if __name__ == "__main__":  # setuptools runs it so; tests import the flag helpers
    from torch.utils.cpp_extension import BuildExtension

    setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
          zip_safe=False)
