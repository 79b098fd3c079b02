// The Autograd kernel of a backward-only op (attention_bwd, rms_norm_bwd, ...: kernels with no backward
// of their own). It runs the op below autograd, so the outputs never require grad and a gradient taken
// through them fails with autograd's own error. Without it, torch's fallback for an op that has no
// autograd kernel builds a node that warns when reached and (deprecated) passes no gradient on. The
// public paths never differentiate these ops: each op's backward is once-differentiable
// (python/fuseforge/ops/_eager.py) and raises on a double backward before reaching them.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace fuseforge {

inline void run_below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;  // the kernel's own ATen calls skip autograd too
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

// m.impl("<op>_bwd", not_differentiable()) inside TORCH_LIBRARY_IMPL(fuseforge, Autograd, m).
inline torch::CppFunction not_differentiable() {
  return torch::CppFunction::makeFromBoxedFunction<&run_below_autograd>();
}

}  // namespace fuseforge
