// Every fuseforge operator schema, in one TORCH_LIBRARY block, and nothing else.
// Implementations register per dispatch key beside their kernels (csrc/<op>/*.cpp, *.cu);
// fake kernels and autograd are registered in python/fuseforge/ops/*.py.
#include <torch/library.h>

#ifndef FUSEFORGE_NO_PYTHON  // the GoogleTest build links the ops without Python
#include <Python.h>
// Importing fuseforge._C loads this library and runs the static registrations below; no pybind11,
// so the extension can use the limited Python API.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
#endif

TORCH_LIBRARY(fuseforge, m) {
  // ---- add_mul_act: act(x + alpha * y + bias) ------------------------------------------------
  m.def("add_mul_act(Tensor x, Tensor y, Tensor? bias, float alpha, str activation) -> Tensor");
  // Training forward: also returns what the backward needs (a bit mask for relu, else the
  // pre-activation x + alpha * y + bias).
  m.def("add_mul_act_fwd(Tensor x, Tensor y, Tensor? bias, float alpha, str activation)"
        " -> (Tensor out, Tensor saved)");
  // Unrequested gradients come back as empty tensors.
  m.def("add_mul_act_bwd(Tensor grad_out, Tensor saved, float alpha, str activation,"
        " bool need_grad_y, bool need_grad_bias) -> (Tensor grad_x, Tensor grad_y, Tensor grad_bias)");
  m.def("add_mul_act_(Tensor(a!) x, Tensor y, Tensor? bias, float alpha, str activation) -> ()");

  // ---- adamw: multi-tensor-apply fused AdamW -------------------------------------------------
  // (schemas owned by the AdamW work; keep them inside this marked block)
  // ---- end adamw ------------------------------------------------------------------------------

  // ---- linear_cross_entropy -------------------------------------------------------------------
  // ---- end linear_cross_entropy ---------------------------------------------------------------

  // ---- attention ------------------------------------------------------------------------------
  // ---- end attention --------------------------------------------------------------------------
}
