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
  // The optimizer's fast path: a per-device C++ handle (an integer id) that holds the parameters, reads
  // their .grad itself, creates states lazily and keeps the packed metadata between steps. `steps` (the
  // handle's float32 step counts, one per parameter) picks the backend.
  // param_flags: amsgrad 1, master weights 2, bfloat16 states 4, int8 states 8, paged 16; bits 32 and up an
  // int8 absmax length (csrc/adamw/adamw.h).
  m.def("adamw_handle_create(Tensor[] params, int[] param_groups, int[] param_flags, Tensor steps,"
        " int num_groups) -> int");
  // hypers: (lr, beta1, beta2, eps, weight_decay, maximize) per group; lr_tensors: [] or one per group.
  // Returns how many parameters got their state created in this step.
  m.def("adamw_handle_step(int handle, Tensor(a!) steps, float[] hypers, Tensor?[] lr_tensors,"
        " Tensor? grad_scale, Tensor? found_inf) -> int");
  m.def("adamw_handle_new_slots(int handle, Tensor steps) -> int[]");
  // [exp_avg, exp_avg_sq, max_exp_avg_sq, master_param, exp_avg_absmax, exp_avg_sq_absmax] (absent ones as
  // empty bool tensors), or [] (no state). set_state converts what it is given to the parameter's format.
  m.def("adamw_handle_state(int handle, Tensor steps, int slot) -> Tensor[]");
  m.def("adamw_handle_set_state(int handle, Tensor steps, int slot, Tensor[] states) -> Tensor[]");
  m.def("adamw_handle_zero_grad(int handle, Tensor steps, bool set_to_none) -> ()");
  m.def("adamw_handle_destroy(int handle, Tensor steps) -> ()");
  // Whether t's memory is CUDA managed memory (where paged=True keeps optimizer states).
  m.def("adamw_is_managed(Tensor t) -> bool");
  // One group's step over tensor lists (torch._fused_adamw_-like; it also advances state_steps):
  // the path under torch.compile and for functional use. A tensor's state format follows its exp_avg's
  // dtype; uint8 (int8 codes) takes its block scales from the absmax lists (empty when no tensor has them).
  m.def("adamw_fused_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs,"
        " Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] master_params, Tensor(g!)[] state_steps,"
        " Tensor(h!)[] exp_avg_absmaxs, Tensor(i!)[] exp_avg_sq_absmaxs, *, float lr,"
        " float beta1, float beta2, float weight_decay, float eps, bool maximize, Tensor? lr_tensor=None,"
        " Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // ---- end adamw ------------------------------------------------------------------------------

  // ---- linear_cross_entropy -------------------------------------------------------------------
  // loss of cross_entropy(x @ weight.T + bias, target) without materialising the logits. When a
  // gradient is requested and reduction is 'mean' or 'sum', the forward also returns the gradients
  // (of the loss itself; the backward multiplies them by grad_loss * grad_scale). lse: (2, N) per-row
  // log-sum-exp and -log p(target) (float32; float64 for float64 inputs) for the recomputing
  // backward. softcap 0: none. Unrequested gradients come back as empty tensors. entropy (reduction
  // 'none' only): also each token's entropy -sum p log p of its (capped) logits' distribution, 0 for
  // ignored tokens (else an empty tensor).
  m.def("linear_cross_entropy_fwd(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index,"
        " str reduction, float label_smoothing, float z_loss, float softcap, bool low_memory, bool grad_x,"
        " bool grad_weight, bool grad_bias, bool entropy=False)"
        " -> (Tensor loss, Tensor lse, Tensor grad_x, Tensor grad_weight, Tensor grad_bias, Tensor grad_scale,"
        " Tensor entropy)");
  // Recomputing backward: gradients of sum(grad_loss * loss) for any grad_loss (per token for 'none'),
  // plus sum(grad_entropy * entropy) when grad_entropy is given (with the forward's entropy).
  m.def("linear_cross_entropy_bwd(Tensor grad_loss, Tensor x, Tensor weight, Tensor target, Tensor? bias,"
        " Tensor lse, int ignore_index, str reduction, float label_smoothing, float z_loss, float softcap,"
        " bool low_memory, bool grad_x, bool grad_weight, bool grad_bias, Tensor? entropy=None,"
        " Tensor? grad_entropy=None) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");
  // Multiplies the forward's gradients by grad_loss * grad_scale in place (skipped on the device
  // when that product is 1, the usual case: no pass over the weight gradient).
  m.def("linear_cross_entropy_scale_grads_(Tensor(a!) grad_x, Tensor(b!) grad_weight, Tensor(c!) grad_bias,"
        " Tensor grad_loss, Tensor grad_scale) -> ()");
  // A chunk of logits the caller holds (logits = x @ weight.T in x's dtype, N x V): the chunked
  // sequence-level losses (fuseforge.nn's preference losses) form each chunk's gradient weights
  // between these two. rows_stats: (3, N) float32 (float64 for float64) per-row lse and
  // -log p(target) of the logits plus bias, capped (softcap 0: none), with the exact x . W[t] for
  // the target's logit (the third row); 0 for ignored rows. rows_grad_: overwrites the logits with
  // d/dlogits of sum_n row_scale_n * (-log p_n(target)) (zero rows for ignored targets).
  m.def("linear_cross_entropy_rows_stats(Tensor logits, Tensor x, Tensor weight, Tensor target, Tensor? bias,"
        " int ignore_index, float softcap) -> Tensor");
  m.def("linear_cross_entropy_rows_grad_(Tensor(a!) logits, Tensor stats, Tensor target, Tensor? bias,"
        " Tensor row_scale, int ignore_index, float softcap) -> ()");
  // ---- end linear_cross_entropy ---------------------------------------------------------------

  // ---- linear_jsd: distillation between two linear heads' softmaxes -----------------------------
  // Generalised JSD (beta in (0, 1)), forward KL(P||Q) (beta 0) or reverse KL(Q||P) (beta 1) of the
  // teacher's P = softmax(teacher_x @ teacher_weight.T / temperature) and the student's Q (the same
  // with student_x, student_weight), without materialising either's logits. target (or None) only
  // marks tokens equal to ignore_index as skipped. With reduction 'mean'/'sum' and a gradient
  // requested, the forward also returns the student's gradients of the loss (the backward multiplies
  // them by grad_loss * grad_scale, with linear_cross_entropy_scale_grads_). Unrequested gradients
  // come back as empty tensors. The teacher gets no gradient.
  m.def("linear_jsd_fwd(Tensor student_x, Tensor student_weight, Tensor teacher_x, Tensor teacher_weight,"
        " Tensor? target, float beta, float temperature, int ignore_index, str reduction, bool grad_x,"
        " bool grad_weight) -> (Tensor loss, Tensor grad_x, Tensor grad_weight, Tensor grad_scale)");
  // Recomputing backward: the student's gradients of sum(grad_loss * loss) (per token for 'none').
  m.def("linear_jsd_bwd(Tensor grad_loss, Tensor student_x, Tensor student_weight, Tensor teacher_x,"
        " Tensor teacher_weight, Tensor? target, float beta, float temperature, int ignore_index,"
        " str reduction, bool grad_x, bool grad_weight) -> (Tensor grad_x, Tensor grad_weight)");
  // ---- end linear_jsd ---------------------------------------------------------------------------

  // ---- attention ------------------------------------------------------------------------------
  // softmax(z) v with z = scale * q k^T (or softcap * tanh(scale * q k^T / softcap) when softcap > 0)
  // under a mask aligned bottom-right (off = Sk - Sq): query i sees key j when
  // i + off - window_left <= j <= i + off + window_right, -1 meaning unbounded on that side; causal
  // is window_right = 0. SDPA's layout: q (B, Hq, Sq, D), k and v (B, Hk, Sk, D), Hk dividing Hq.
  // Returns the output (strides of q) and the fp32 (fp64 for fp64 inputs) log-sum-exp (B, Hq, Sq) of
  // each row's z (-inf where a row attends to nothing; its output is zero).
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, int window_left=-1,"
        " int window_right=-1, float softcap=0.0) -> (Tensor out, Tensor lse)");
  // Gradients from the forward's out and lse; deterministic=True avoids floating-point atomics.
  m.def("attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal,"
        " float scale, bool deterministic, int window_left=-1, int window_right=-1, float softcap=0.0)"
        " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Packed variable-length batches (FlashAttention's varlen layout): q (total_q, Hq, D), k and v
  // (total_k, Hk, D); sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]) (int32, B + 1 entries, on
  // q's device). max_seqlen_q / max_seqlen_k bound every sequence's length (the caller's numbers: the
  // op never reads cu_seqlens on the host). The mask is per sequence, as above; lse is (Hq, total_q).
  m.def("attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,"
        " int max_seqlen_q, int max_seqlen_k, bool causal, float scale, int window_left=-1,"
        " int window_right=-1, float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def("attention_varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
        " Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal,"
        " float scale, bool deterministic, int window_left=-1, int window_right=-1, float softcap=0.0)"
        " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // ---- end attention --------------------------------------------------------------------------

  // ---- rms_norm ---------------------------------------------------------------------------------
  // h = x + residual (rounded to x's dtype, as the unfused add) or x; over the last dim,
  // out = h * rstd * (weight_offset + weight), rstd = 1 / sqrt(mean(h^2) + eps), statistics in fp32
  // (fp64 for fp64). weight_offset 0 is Llama's w * x, 1 Gemma's (1 + w) * x; no weight: w = 1.
  // weight is x's dtype or float32. out is out_dtype (default x's dtype: an autocast caller asks for the
  // matmul's dtype directly). residual_out is h (empty without a residual: the caller keeps x), rstd is
  // (rows,) float32 (float64 for float64 inputs).
  m.def("rms_norm_fwd(Tensor x, Tensor? weight, Tensor? residual, float eps, float weight_offset,"
        " ScalarType? out_dtype=None) -> (Tensor out, Tensor residual_out, Tensor rstd)");
  // The forward without rstd, for calls that need no gradient (inference): the same outputs bit for bit.
  m.def("rms_norm(Tensor x, Tensor? weight, Tensor? residual, float eps, float weight_offset,"
        " ScalarType? out_dtype=None) -> (Tensor out, Tensor residual_out)");
  // Gradients from h (the forward's residual_out, or x) and rstd: grad_input = d(loss)/dh, which is also
  // the residual's gradient, including grad_residual_out (the gradient reaching residual_out) when
  // given; grad_input has h's dtype. grad_weight (weight's dtype, reduced in fp32 deterministically) only
  // when need_grad_weight, else empty.
  m.def("rms_norm_bwd(Tensor grad_out, Tensor? grad_residual_out, Tensor h, Tensor? weight, Tensor rstd,"
        " float weight_offset, bool need_grad_weight) -> (Tensor grad_input, Tensor grad_weight)");
  // LayerNorm on the same kernels: h as above; out = (h - mean) * rstd * weight + bias, mean = mean(h),
  // rstd = 1 / sqrt(mean((h - mean)^2) + eps) (fp32; fp64 for fp64); weight and bias (x's dtype or
  // float32) optional. mean and rstd are (rows,).
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps,"
        " ScalarType? out_dtype=None) -> (Tensor out, Tensor residual_out, Tensor mean, Tensor rstd)");
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps,"
        " ScalarType? out_dtype=None) -> (Tensor out, Tensor residual_out)");
  // grad_input as rms_norm_bwd's; grad_weight (weight's dtype) when need_grad_weight; grad_bias (the
  // column sums of grad_out) in grad_bias_dtype, the bias's (h's dtype or float32), when it is given;
  // else empty.
  m.def("layer_norm_bwd(Tensor grad_out, Tensor? grad_residual_out, Tensor h, Tensor? weight, Tensor mean,"
        " Tensor rstd, bool need_grad_weight, ScalarType? grad_bias_dtype)"
        " -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // ---- end rms_norm -----------------------------------------------------------------------------

  // ---- rotary -----------------------------------------------------------------------------------
  // Rotary position embedding of q (B, Hq, S, D) and k (B, Hk, S, D) (any strides, the last dim dense)
  // from position_ids (B or 1, S; int32/int64) and inv_freq (R / 2,) float32: the first R = 2 *
  // inv_freq.numel() <= D dims of each head rotate by angle position * inv_freq[i] (computed in fp32,
  // as Hugging Face does), cos and sin scaled by attention_scaling; dims R..D pass through (partial
  // rotary). interleaved=False pairs dim i with i + R / 2 (Llama's rotate_half), True pairs 2i with 2i + 1.
  // inverse=True rotates by -angle: the backward. Outputs are out_dtype (default the input's) in
  // (B, S, H, D) memory, returned as (B, H, S, D) views, like the projections' outputs.
  m.def("rotary(Tensor q, Tensor k, Tensor inv_freq, Tensor position_ids, float attention_scaling,"
        " bool interleaved, bool inverse, ScalarType? out_dtype=None) -> (Tensor q_out, Tensor k_out)");
  // ---- end rotary -------------------------------------------------------------------------------

  // ---- glu: gated activation act(gate) * up ----------------------------------------------------
  // gate and up of one shape (any rank; rows may be strided, the last dim dense), or up None and gate
  // the fused projection's output (..., 2I) = [gate | up] (Phi-3's gate_up_proj). activation: silu
  // (SwiGLU), gelu_tanh (GeGLU), gelu. fp32 arithmetic (fp64 for fp64); out (..., I) in gate's dtype.
  m.def("glu_fwd(Tensor gate, Tensor? up, str activation) -> Tensor");
  // Recomputes act(gate) (nothing but gate and up is saved). With up None, grad_gate is the fused
  // (..., 2I) gradient and grad_up is empty.
  m.def("glu_bwd(Tensor grad_out, Tensor gate, Tensor? up, str activation) -> (Tensor grad_gate, Tensor grad_up)");
  // ---- end glu ----------------------------------------------------------------------------------
}
