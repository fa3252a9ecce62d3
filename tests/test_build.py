"""The package installs and imports as documented; the C++ op library loads."""
import subprocess
import sys


def test_public_imports_from_outside_the_checkout(tmp_path):
    code = "import arl, arl.kernels; from arl import policy_loss, LossConfig; print(arl.kernels.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "arl.kernels"


def test_kernels_is_not_a_top_level_module(tmp_path):
    # `kernels` belongs to a Hugging Face package that transformers imports: arl must not shadow it
    code = "import importlib.util, arl; s = importlib.util.find_spec('kernels'); print(s.origin if s else None)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "/arl" not in out.stdout and "main/kernels" not in out.stdout, out.stdout


def test_cpp_op_library_loads():
    import torch

    import arl._C  # noqa: F401  registers torch.ops.arl.*

    assert hasattr(torch.ops, "arl")
    assert len(list(torch.ops.arl.__dir__())) > 0


def test_install_script_is_idempotent():
    """A second run of install.sh finds every pin satisfied and installs nothing (it only checks
    pins, rebuilds the C++ ops incrementally and imports arl)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["bash", os.path.join(root, "install.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[install] installing" not in out.stdout, out.stdout
    assert "[install] arl ready" in out.stdout
