"""arl's fused ops, one folder per op: each holds its Python API, its specification or torch path,
its Triton kernel (triton_kernel.py) and the Python side of its C++/CUDA op (sources in csrc/<op>/)."""
