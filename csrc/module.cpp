// Python module stub for arl._C: importing it runs the TORCH_LIBRARY registrations of every
// csrc/<op>/*.cpp (CPU) in this shared object; the ops are then torch.ops.arl.<name>.
#include <Python.h>

static struct PyModuleDef arl_c_module = {PyModuleDef_HEAD_INIT, "_C", "arl C++ CPU ops", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&arl_c_module); }
