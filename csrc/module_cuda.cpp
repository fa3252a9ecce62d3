// Python module stub for arl._C_cuda: importing it runs the TORCH_LIBRARY registrations of every
// csrc/<op>/*_cuda.cpp and *.cu in this shared object; the ops are then torch.ops.arl.<name>_cuda.
#include <Python.h>

static struct PyModuleDef arl_cuda_module = {PyModuleDef_HEAD_INIT, "_C_cuda", "arl CUDA ops", -1, nullptr};

PyMODINIT_FUNC PyInit__C_cuda(void) { return PyModule_Create(&arl_cuda_module); }
