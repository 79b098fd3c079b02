// fused AdamW: the per-device handle (parameter scan, lazy state creation, metadata packing), the
// input checks, the CPU backend (the same math as the CUDA kernel, over the same block map), and the
// CPU / CompositeExplicitAutograd registrations.
#include "adamw/adamw.h"

#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "adamw/adamw_cpu.h"
#include "adamw/adamw_math.h"
#include "common/env.h"

namespace fuseforge::adamw {

// Elements a CUDA block updates (one chunk of a tensor). Development knob FUSEFORGE_ADAMW_CHUNK_ELEMS
// (docs/design/adamw.md): overrides kDefaultChunkElems. Read once per process.
static int64_t chunk_elems_setting() {
  static_assert(kDefaultChunkElems % kQuantBlock == 0, "chunks hold whole quantization blocks");
  static const int64_t chunk = [] {
    const int64_t c = dev_positive_int("FUSEFORGE_ADAMW_CHUNK_ELEMS", kDefaultChunkElems);
    TORCH_CHECK(c % kQuantBlock == 0, "FUSEFORGE_ADAMW_CHUNK_ELEMS: expected a multiple of ", kQuantBlock,
                " (chunks hold whole quantization blocks of int8 states), got ", c);
    return c;
  }();
  return chunk;
}

// ---- checks -------------------------------------------------------------------------------------

ParamDtype param_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ParamDtype::kFloat;
    case at::kHalf: return ParamDtype::kHalf;
    case at::kBFloat16: return ParamDtype::kBFloat16;
    case at::kDouble: return ParamDtype::kDouble;
    default: TORCH_CHECK(false, "AdamW: unsupported parameter dtype ", t);
  }
}

static at::ScalarType state_dtype_of(at::ScalarType param) { return param == at::kDouble ? at::kDouble : at::kFloat; }

// The dtype of a moment stored in `format` for a parameter of dtype `param` (int8 codes are uint8).
static at::ScalarType moment_dtype(StateFormat format, at::ScalarType param) {
  switch (format) {
    case StateFormat::kBFloat16: return at::kBFloat16;
    case StateFormat::kInt8: return at::kByte;
    default: return state_dtype_of(param);
  }
}

void check_param(const at::Tensor& p, const char* what, int64_t index) {
  TORCH_CHECK(p.defined(), "AdamW: ", what, " ", index, " is undefined");
  TORCH_CHECK(!p.is_complex(), "AdamW: ", what, " ", index,
              " is complex; fuseforge AdamW takes real float32/float16/bfloat16 parameters (view complex ones "
              "with torch.view_as_real)");
  TORCH_CHECK(p.layout() == at::kStrided, "AdamW: ", what, " ", index, " must be a dense (strided) tensor, got ",
              p.layout());
  const auto st = p.scalar_type();
  const bool cuda_ok = st == at::kFloat || st == at::kHalf || st == at::kBFloat16;
  TORCH_CHECK(cuda_ok || (st == at::kDouble && p.device().is_cpu()), "AdamW: ", what, " ", index,
              " must be float32, float16 or bfloat16 (or float64 on the CPU), got ", st, " on ", p.device());
  TORCH_CHECK(p.device().is_cpu() || p.device().is_cuda(), "AdamW: ", what, " ", index,
              " must be on the CPU or a CUDA device, got ", p.device());
  TORCH_CHECK(p.is_non_overlapping_and_dense(), "AdamW: ", what, " ", index,
              " must be non-overlapping and dense (the update treats it as one flat array), got sizes ", p.sizes(),
              " strides ", p.strides());
}

static bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes())) return false;
  if (a.strides().equals(b.strides())) return true;
  return a.is_contiguous() && b.is_contiguous();  // size-1 dims may carry any stride
}

void check_grad(const at::Tensor& g, const at::Tensor& p, int64_t index) {
  TORCH_CHECK(g.layout() == at::kStrided, "AdamW does not support sparse gradients (parameter ", index,
              " has a ", g.layout(), " grad); use torch.optim.SparseAdam");
  TORCH_CHECK(g.scalar_type() == p.scalar_type(), "AdamW: the grad of parameter ", index, " must have the param's dtype ",
              p.scalar_type(), ", got ", g.scalar_type());
  TORCH_CHECK(g.device() == p.device(), "AdamW: the grad of parameter ", index, " must be on ", p.device(), ", got ",
              g.device());
  TORCH_CHECK(g.sizes().equals(p.sizes()), "AdamW: the grad of parameter ", index, " must have the param's sizes ",
              p.sizes(), ", got ", g.sizes());
}

// A grad whose strides differ from its param's is updated through a copy with the param's layout
// (written back afterwards when the step writes grads).
static at::Tensor grad_in_param_layout(const at::Tensor& g, const at::Tensor& p) {
  if (same_layout(g, p)) return g;
  return at::empty_strided(p.sizes(), p.strides(), g.options()).copy_(g);
}

GroupHyper make_group_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                            const std::optional<at::Tensor>& lr_tensor, at::Device device) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "AdamW: eps must be >= 0, got ", eps);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, "AdamW: betas[0] must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, "AdamW: betas[1] must be in [0, 1), got ", beta2);
  TORCH_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "AdamW: weight_decay must be >= 0, got ", weight_decay);
  GroupHyper h;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.maximize = maximize ? 1 : 0;
  if (lr_tensor.has_value() && lr_tensor->defined()) {
    const at::Tensor& t = *lr_tensor;
    TORCH_CHECK(t.numel() == 1 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
                "AdamW: a tensor lr must hold one float32 or float64 value, got ", t.scalar_type(), " of shape ",
                t.sizes());
    if (t.device() == device) {
      // Read by the kernel at run time: schedulers' lr.fill_() reaches CUDA-graph replays.
      h.lr_ptr = t.const_data_ptr();
      h.lr_is_double = t.scalar_type() == at::kDouble;
      h.lr = std::nan("");
      return h;
    }
    TORCH_CHECK(t.device().is_cpu(), "AdamW: a tensor lr must be on the parameters' device (", device,
                ") or the CPU, got ", t.device());
    lr = t.item<double>();  // a CPU value: no device synchronization
  }
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "AdamW: lr must be >= 0, got ", lr);
  h.lr = lr;
  return h;
}

void check_scale_tensor(const std::optional<at::Tensor>& t, const char* name, at::Device device) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, "AdamW: ", name,
              " must hold one float32 value, got ", t->scalar_type(), " of shape ", t->sizes());
  TORCH_CHECK(t->device() == device, "AdamW: ", name, " must be on ", device, ", got ", t->device());
}

static const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr<float>() : nullptr;
}

// ---- managed memory (paged states) --------------------------------------------------------------

namespace {
ManagedMemory& managed_memory_slot() {
  static ManagedMemory memory;
  return memory;
}
// Paged states start 256-byte aligned (the kernel's aligned path needs 16), as the caching allocator's do.
constexpr int64_t kArenaAlign = 256;
int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
}  // namespace

void set_managed_memory(const ManagedMemory& memory) { managed_memory_slot() = memory; }

const ManagedMemory* managed_memory() {
  const ManagedMemory& m = managed_memory_slot();
  return m.allocate != nullptr ? &m : nullptr;
}

static const ManagedMemory& require_managed_memory() {
  const ManagedMemory* m = managed_memory();
  TORCH_CHECK(m != nullptr, "AdamW: paged=True needs fuseforge built with CUDA (this build has no CUDA backend)");
  return *m;
}

// ---- handle -------------------------------------------------------------------------------------

Handle::Handle(std::vector<at::Tensor> params, const std::vector<int64_t>& groups, const std::vector<int64_t>& flags,
               at::Tensor steps, int64_t num_groups)
    : params_(std::move(params)), flags_(flags), steps_(std::move(steps)), num_groups_(num_groups),
      device_(steps_.device()) {
  const int64_t n = static_cast<int64_t>(params_.size());
  TORCH_CHECK(static_cast<int64_t>(groups.size()) == n && static_cast<int64_t>(flags.size()) == n,
              "adamw_handle_create: param_groups and param_flags need one entry per parameter (", n, "), got ",
              groups.size(), " and ", flags.size());
  TORCH_CHECK(num_groups >= 1, "adamw_handle_create: num_groups must be >= 1, got ", num_groups);
  TORCH_CHECK(steps_.scalar_type() == at::kFloat && steps_.dim() == 1 && steps_.numel() == n && steps_.is_contiguous(),
              "adamw_handle_create: steps must be a contiguous float32 vector of ", n, " counts, got ",
              steps_.scalar_type(), " of shape ", steps_.sizes());
  group_of_.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params_[i];
    check_param(p, "parameter", i);
    TORCH_CHECK(p.device() == device_, "AdamW: all parameters of a handle must be on one device; parameter ", i,
                " is on ", p.device(), ", the others on ", device_);
    TORCH_CHECK(groups[i] >= 0 && groups[i] < num_groups, "adamw_handle_create: group index ", groups[i],
                " of parameter ", i, " is outside [0, ", num_groups, ")");
    TORCH_CHECK(!((flags[i] & kFlagStateInt8) && (flags[i] & kFlagStateBFloat16)), "adamw_handle_create: parameter ",
                i, " has both the bfloat16 and the int8 state flag");
    TORCH_CHECK(!((flags[i] & kFlagStateInt8) && (flags[i] & kFlagAmsgrad)),
                "AdamW: amsgrad is not supported with int8 states (parameter ", i, ")");
    TORCH_CHECK((flags[i] >> kAbsmaxLenShift) == 0 || (flags[i] & kFlagStateInt8), "adamw_handle_create: parameter ",
                i, " gives an absmax length without the int8 state flag");
    group_of_[i] = static_cast<int32_t>(groups[i]);
  }
  slots_.resize(n);
  param_ptr_.assign(n, nullptr);
  param_dtype_.assign(n, at::ScalarType::Undefined);
  grad_impl_.assign(n, nullptr);
  grad_ptr_.assign(n, nullptr);
  table_index_.assign(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    param_ptr_[i] = params_[i].const_data_ptr();
    param_dtype_[i] = params_[i].scalar_type();
  }
  reserve_arena();
}

int64_t Handle::absmax_len(int64_t slot) const {
  return std::max(quant_blocks(params_[slot].numel()), flags_[slot] >> kAbsmaxLenShift);
}

// One managed allocation with a region for every state a paged slot will have. Only the pages a
// state touches take memory, so slots that never get a grad cost address space only.
void Handle::reserve_arena() {
  const int64_t n = static_cast<int64_t>(params_.size());
  std::array<int64_t, kNumStates> none;
  none.fill(-1);
  arena_at_.assign(n, none);
  none.fill(0);
  arena_bytes_.assign(n, none);
  int64_t total = 0;
  for (int64_t slot = 0; slot < n; ++slot) {
    if (!paged(slot)) continue;
    const at::Tensor& p = params_[slot];
    const StateFormat format = format_of(slot);
    auto reserve = [&](int which, at::ScalarType dtype, int64_t numel) {
      const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
      if (bytes == 0) return;
      total = round_up(total, kArenaAlign);
      arena_at_[slot][which] = total;
      arena_bytes_[slot][which] = bytes;
      total += bytes;
    };
    const auto moment = moment_dtype(format, p.scalar_type());
    reserve(kExpAvg, moment, p.numel());
    reserve(kExpAvgSq, moment, p.numel());
    if (flags_[slot] & kFlagAmsgrad) reserve(kMaxExpAvgSq, moment, p.numel());
    if ((flags_[slot] & kFlagMaster) && (p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16))
      reserve(kMaster, at::kFloat, p.numel());
    if (format == StateFormat::kInt8) {
      reserve(kExpAvgAbsmax, at::kFloat, absmax_len(slot));
      reserve(kExpAvgSqAbsmax, at::kFloat, absmax_len(slot));
    }
  }
  if (total == 0) return;
  const ManagedMemory& memory = require_managed_memory();
  arena_ = c10::Storage(c10::Storage::use_byte_size_t(), total, memory.allocate(static_cast<size_t>(total), device_),
                        /*allocator=*/nullptr, /*resizable=*/false);
}

at::Tensor Handle::state_storage(int64_t slot, int which, at::ScalarType dtype) const {
  const at::Tensor& p = params_[slot];
  const bool absmax = which == kExpAvgAbsmax || which == kExpAvgSqAbsmax;
  const std::vector<int64_t> sizes = absmax ? std::vector<int64_t>{absmax_len(slot)} : p.sizes().vec();
  const std::vector<int64_t> strides = absmax ? std::vector<int64_t>{1} : p.strides().vec();
  const auto opts = p.options().dtype(dtype);
  const int64_t numel = absmax ? absmax_len(slot) : p.numel();
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (!paged(slot) || bytes == 0) return at::empty_strided(sizes, strides, opts);
  c10::Storage storage = arena_;
  int64_t offset = arena_at_[slot][which];
  if (offset < 0 || bytes > arena_bytes_[slot][which]) {
    // The parameter changed since the handle reserved its region: an allocation of its own.
    storage = c10::Storage(c10::Storage::use_byte_size_t(), bytes,
                           require_managed_memory().allocate(static_cast<size_t>(bytes), device_), nullptr, false);
    offset = 0;
  }
  // A storage of its own a state (serialized alone), whose deleter keeps the arena alive.
  auto* base = static_cast<uint8_t*>(storage.mutable_data()) + offset;
  return at::for_blob(base, sizes)
      .strides(strides)
      .deleter([keep = storage](void*) {})
      .options(opts)
      .target_device(device_)
      .make_tensor();
}

at::Tensor Handle::place(int64_t slot, int which, const at::Tensor& value) const {
  if (!value.defined() || !paged(slot) || value.numel() == 0) return value;
  const int64_t offset = arena_at_[slot][which];
  if (offset >= 0 && arena_ && value.const_data_ptr() == static_cast<const uint8_t*>(arena_.data()) + offset)
    return value;
  at::Tensor out = state_storage(slot, which, value.scalar_type());
  return out.copy_(value.reshape(out.sizes()));
}

StateFormat Handle::format_of(int64_t slot) const {
  if (params_[slot].scalar_type() == at::kDouble) return StateFormat::kFull;  // float64 keeps float64 states
  if (flags_[slot] & kFlagStateInt8) return StateFormat::kInt8;
  if (flags_[slot] & kFlagStateBFloat16) return StateFormat::kBFloat16;
  return StateFormat::kFull;
}

void Handle::init_slot(int64_t slot) {
  const at::Tensor& p = params_[slot];
  SlotState& s = slots_[slot];
  s.format = format_of(slot);
  const auto moment = moment_dtype(s.format, p.scalar_type());
  // Zero codes are zeros whatever the block's absmax.
  s.exp_avg = state_storage(slot, kExpAvg, moment).zero_();
  s.exp_avg_sq = state_storage(slot, kExpAvgSq, moment).zero_();
  if (s.format == StateFormat::kInt8) {
    s.exp_avg_absmax = state_storage(slot, kExpAvgAbsmax, at::kFloat).zero_();
    s.exp_avg_sq_absmax = state_storage(slot, kExpAvgSqAbsmax, at::kFloat).zero_();
  }
  if (flags_[slot] & kFlagAmsgrad)  // (never int8: rejected at creation)
    s.max_exp_avg_sq = state_storage(slot, kMaxExpAvgSq, moment).zero_();
  if ((flags_[slot] & kFlagMaster) && p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble)
    s.master = state_storage(slot, kMaster, state_dtype_of(p.scalar_type())).copy_(p);
  s.initialized = true;
}

// ---- conversions of loaded states ---------------------------------------------------------------

namespace {

// The elements of a non-overlapping and dense tensor in memory order (the order of int8 blocks).
at::Tensor memory_order(const at::Tensor& t) { return t.as_strided({t.numel()}, {1}, t.storage_offset()); }

// int8 codes (any device) and their block scales -> float32 values on the CPU, laid out as the codes.
at::Tensor dequantize_codes(const at::Tensor& codes, const at::Tensor& absmax, bool squared) {
  const at::Tensor c = codes.cpu();
  const at::Tensor a = absmax.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor out = at::empty_strided(c.sizes(), c.strides(), c.options().dtype(at::kFloat));
  const uint8_t* cp = memory_order(c).const_data_ptr<uint8_t>();
  float* op = memory_order(out).mutable_data_ptr<float>();
  const float* ap = a.const_data_ptr<float>();
  const int64_t n = c.numel();
  for (int64_t b = 0; b < quant_blocks(n); ++b) {
    const int64_t end = std::min(n, (b + 1) * kQuantBlock);
    if (squared) {
      const float scale = decode_scale<ExpAvgSqCode>(ap[b]);
      for (int64_t i = b * kQuantBlock; i < end; ++i) op[i] = decode_exp_avg_sq(cp[i], scale);
    } else {
      const float scale = decode_scale<ExpAvgCode>(ap[b]);
      for (int64_t i = b * kQuantBlock; i < end; ++i) op[i] = decode_exp_avg(cp[i], scale);
    }
  }
  return out;
}

// values (any float dtype and device, p's number of elements) -> int8 codes in p's layout and their
// block scales, on p's device: the kernel's quantizer (adamw_lowbit.h) run on the CPU.
// `absmax_len` >= the block count pads the scales with zeros (see kAbsmaxLenShift).
std::pair<at::Tensor, at::Tensor> quantize_values(const at::Tensor& values, const at::Tensor& p, bool squared,
                                                  int64_t absmax_len) {
  const auto cpu = at::TensorOptions().device(at::kCPU);
  const at::Tensor x =
      at::empty_strided(p.sizes(), p.strides(), cpu.dtype(at::kFloat)).copy_(values.reshape(p.sizes()));
  at::Tensor codes = at::empty_strided(p.sizes(), p.strides(), cpu.dtype(at::kByte));
  at::Tensor absmax = at::zeros({absmax_len}, cpu.dtype(at::kFloat));
  const float* xp = memory_order(x).const_data_ptr<float>();
  uint8_t* cp = memory_order(codes).mutable_data_ptr<uint8_t>();
  float* ap = absmax.mutable_data_ptr<float>();
  const int64_t n = p.numel();
  for (int64_t b = 0; b < quant_blocks(n); ++b) {
    const int64_t begin = b * kQuantBlock, end = std::min(n, begin + kQuantBlock);
    uint32_t key = 0;
    for (int64_t i = begin; i < end; ++i) key = std::max(key, magnitude_key(xp[i]));
    const float amax = bits_float(key);
    ap[b] = amax;
    if (squared) {
      const float scale = encode_scale<ExpAvgSqCode>(amax);
      for (int64_t i = begin; i < end; ++i) cp[i] = encode_exp_avg_sq(xp[i], scale);
    } else {
      const float scale = encode_scale<ExpAvgCode>(amax);
      for (int64_t i = begin; i < end; ++i) cp[i] = encode_exp_avg(xp[i], scale);
    }
  }
  return {codes.to(p.device()), absmax.to(p.device())};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> Handle::adopt_moment(int64_t slot, StateFormat format, const at::Tensor& value,
                                                       const at::Tensor& absmax, bool squared, const char* what) const {
  const at::Tensor& p = params_[slot];
  TORCH_CHECK(value.defined() && value.layout() == at::kStrided && value.numel() == p.numel(), "AdamW: state '", what,
              "' of parameter ", slot, " must be a dense tensor of ", p.numel(), " elements, got ",
              value.defined() ? value.sizes() : at::IntArrayRef{});
  at::Tensor values = value;
  if (value.scalar_type() == at::kByte) {  // int8 codes: they need their block scales
    const int64_t blocks = quant_blocks(p.numel());
    const int64_t padded = absmax_len(slot);
    TORCH_CHECK(absmax.defined() && absmax.scalar_type() == at::kFloat && absmax.dim() == 1 &&
                    (absmax.numel() == blocks || absmax.numel() == padded),
                "AdamW: state '", what, "' of parameter ", slot, " holds int8 codes, so '", what,
                "_absmax' must hold its ", blocks, " float32 block scales (one per ", kQuantBlock, " elements",
                padded != blocks ? c10::str("; ", padded, " with the padding of a DTensor shard") : std::string(),
                "), got ",
                absmax.defined() ? c10::str(absmax.scalar_type(), " of shape ", absmax.sizes()) : std::string("none"));
    TORCH_CHECK(value.is_non_overlapping_and_dense(), "AdamW: int8 state '", what, "' of parameter ", slot,
                " must be non-overlapping and dense (its blocks follow memory order)");
    if (format == StateFormat::kInt8 && same_layout(value, p)) {
      at::Tensor scales = absmax.to(p.device()).contiguous();
      if (scales.numel() != padded) {  // unpadded scales of a padded slot
        at::Tensor full = at::zeros({padded}, scales.options());
        full.narrow(0, 0, blocks).copy_(scales);
        scales = full;
      }
      return {value.to(p.device()), scales};
    }
    values = dequantize_codes(value, absmax, squared);
  }
  if (format == StateFormat::kInt8) return quantize_values(values, p, squared, absmax_len(slot));
  return {adopt_state(slot, values, moment_dtype(format, p.scalar_type()), what), at::Tensor()};
}

at::Tensor Handle::adopt_state(int64_t slot, const at::Tensor& value, at::ScalarType dtype, const char* what) const {
  const at::Tensor& p = params_[slot];
  TORCH_CHECK(value.defined() && value.layout() == at::kStrided && value.numel() == p.numel(), "AdamW: state '", what,
              "' of parameter ", slot, " must be a dense tensor of ", p.numel(), " elements, got ",
              value.defined() ? value.sizes() : at::IntArrayRef{});
  if (value.scalar_type() == dtype && value.device() == p.device() && same_layout(value, p)) return value;
  return at::empty_strided(p.sizes(), p.strides(), p.options().dtype(dtype)).copy_(value.reshape(p.sizes()));
}

std::vector<at::Tensor> Handle::set_slot_state(int64_t slot, const std::vector<at::Tensor>& states) {
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots_.size()), "AdamW: slot ", slot, " out of range");
  SlotState& s = slots_[slot];
  table_dirty_ = true;
  if (states.empty()) {
    s = SlotState{};
    return {};
  }
  const at::Tensor& p = params_[slot];
  const bool amsgrad = flags_[slot] & kFlagAmsgrad;
  const bool master = (flags_[slot] & kFlagMaster) && p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble;
  TORCH_CHECK(states.size() == kNumStates, "adamw_handle_set_state: expects [exp_avg, exp_avg_sq, max_exp_avg_sq, "
              "master, exp_avg_absmax, exp_avg_sq_absmax], got ", states.size(), " tensors");
  const auto dt = state_dtype_of(p.scalar_type());
  // Loaded moments are converted to this parameter's format: float ones cast or quantized, int8 codes
  // adopted as they are when the format and layout match, else dequantized first.
  // Paged slots then copy them into their managed regions (place).
  s.format = format_of(slot);
  std::tie(s.exp_avg, s.exp_avg_absmax) =
      adopt_moment(slot, s.format, states[kExpAvg], states[kExpAvgAbsmax], /*squared=*/false, "exp_avg");
  std::tie(s.exp_avg_sq, s.exp_avg_sq_absmax) =
      adopt_moment(slot, s.format, states[kExpAvgSq], states[kExpAvgSqAbsmax], /*squared=*/true, "exp_avg_sq");
  s.exp_avg = place(slot, kExpAvg, s.exp_avg);
  s.exp_avg_sq = place(slot, kExpAvgSq, s.exp_avg_sq);
  s.exp_avg_absmax = place(slot, kExpAvgAbsmax, s.exp_avg_absmax);
  s.exp_avg_sq_absmax = place(slot, kExpAvgSqAbsmax, s.exp_avg_sq_absmax);
  s.max_exp_avg_sq = at::Tensor();
  if (amsgrad) {
    const at::Tensor& given = states[kMaxExpAvgSq];
    s.max_exp_avg_sq =
        given.defined() && given.numel() == p.numel()
            ? place(slot, kMaxExpAvgSq, adopt_moment(slot, s.format, given, at::Tensor(), true, "max_exp_avg_sq").first)
            : state_storage(slot, kMaxExpAvgSq, moment_dtype(s.format, p.scalar_type())).zero_();
  }
  s.master = at::Tensor();
  if (master) {
    // A state saved without master weights (e.g. by torch.optim.AdamW) starts the master from the param.
    s.master = states[kMaster].defined() && states[kMaster].numel() == p.numel()
                   ? place(slot, kMaster, adopt_state(slot, states[kMaster], dt, "master_param"))
                   : state_storage(slot, kMaster, dt).copy_(p);
  }
  s.initialized = true;
  return slot_state(slot);
}

std::vector<at::Tensor> Handle::slot_state(int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots_.size()), "AdamW: slot ", slot, " out of range");
  const SlotState& s = slots_[slot];
  if (!s.initialized) return {};
  return {s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, s.master, s.exp_avg_absmax, s.exp_avg_sq_absmax};
}

std::vector<int64_t> Handle::take_new_slots() {
  std::vector<int64_t> out;
  out.swap(new_slots_);
  return out;
}

void Handle::rebuild_table() {
  table_.clear();
  table_slot_.clear();
  std::fill(table_index_.begin(), table_index_.end(), -1);
  std::vector<int64_t> numels;
  float* steps = steps_.mutable_data_ptr<float>();
  for (size_t slot = 0; slot < slots_.size(); ++slot) {
    const SlotState& s = slots_[slot];
    if (!s.initialized) continue;
    const at::Tensor& p = params_[slot];
    TORCH_CHECK(same_layout(s.exp_avg, p), "AdamW: parameter ", slot, " changed shape or strides (now ", p.sizes(),
                ") after its optimizer state was created (", s.exp_avg.sizes(), ")");
    TensorMeta m;
    m.param = p.data_ptr();
    m.exp_avg = s.exp_avg.data_ptr();
    m.exp_avg_sq = s.exp_avg_sq.data_ptr();
    m.max_exp_avg_sq = s.max_exp_avg_sq.defined() ? s.max_exp_avg_sq.data_ptr() : nullptr;
    m.master = s.master.defined() ? s.master.data_ptr() : nullptr;
    m.exp_avg_absmax = s.exp_avg_absmax.defined() ? s.exp_avg_absmax.mutable_data_ptr<float>() : nullptr;
    m.exp_avg_sq_absmax = s.exp_avg_sq_absmax.defined() ? s.exp_avg_sq_absmax.mutable_data_ptr<float>() : nullptr;
    m.step = steps + slot;
    m.numel = p.numel();
    m.group = group_of_[slot];
    m.dtype = static_cast<int32_t>(param_dtype_of(p.scalar_type()));
    m.state_format = static_cast<int32_t>(s.format);
    table_index_[slot] = static_cast<int32_t>(table_.size());
    table_slot_.push_back(static_cast<int32_t>(slot));
    table_.push_back(m);
    numels.push_back(m.numel);
  }
  // Paged states to prefetch: their byte ranges, sorted, merged where only alignment padding of the
  // arena lies between them (one range when every paged slot has state).
  prefetch_.clear();
  const auto* arena_begin = arena_ ? static_cast<const uint8_t*>(arena_.data()) : nullptr;
  const auto* arena_end = arena_ ? arena_begin + arena_.nbytes() : nullptr;
  std::vector<MemRange> ranges;
  for (size_t slot = 0; slot < slots_.size(); ++slot) {
    const SlotState& s = slots_[slot];
    if (!s.initialized || !paged(static_cast<int64_t>(slot))) continue;
    for (const at::Tensor* t : {&s.exp_avg, &s.exp_avg_sq, &s.max_exp_avg_sq, &s.master, &s.exp_avg_absmax,
                                &s.exp_avg_sq_absmax})
      if (t->defined() && t->numel() > 0) ranges.push_back({t->const_data_ptr(), static_cast<size_t>(t->numel() * t->element_size())});
  }
  std::sort(ranges.begin(), ranges.end(), [](const MemRange& a, const MemRange& b) { return a.ptr < b.ptr; });
  auto in_arena = [&](const void* ptr) {
    const auto* b = static_cast<const uint8_t*>(ptr);
    return b >= arena_begin && b < arena_end;
  };
  for (const MemRange& r : ranges) {
    if (!prefetch_.empty()) {
      MemRange& last = prefetch_.back();
      const auto* last_end = static_cast<const uint8_t*>(last.ptr) + last.bytes;
      const auto* start = static_cast<const uint8_t*>(r.ptr);
      if (in_arena(last.ptr) && in_arena(r.ptr) && start >= last_end && start - last_end < kArenaAlign) {
        last.bytes = static_cast<size_t>(start + r.bytes - static_cast<const uint8_t*>(last.ptr));
        continue;
      }
    }
    prefetch_.push_back(r);
  }
  PlanOptions options;
  options.chunk_elems = chunk_elems_setting();
  plan_ = plan_blocks(numels, options);
  for (size_t e = 0; e < table_.size(); ++e) table_[e].num_chunks = plan_.num_chunks[e];
}

int64_t Handle::step(const std::vector<double>& hypers, const std::vector<std::optional<at::Tensor>>& lr_tensors,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                     BackendStepFn backend) {
  TORCH_CHECK(static_cast<int64_t>(hypers.size()) == num_groups_ * kHypersPerGroup, "adamw_handle_step: hypers needs ",
              kHypersPerGroup, " values for each of ", num_groups_, " groups, got ", hypers.size());
  TORCH_CHECK(lr_tensors.empty() || static_cast<int64_t>(lr_tensors.size()) == num_groups_,
              "adamw_handle_step: lr_tensors must be empty or hold one entry per group (", num_groups_, "), got ",
              lr_tensors.size());
  check_scale_tensor(grad_scale, "grad_scale", device_);
  check_scale_tensor(found_inf, "found_inf", device_);
  groups_.resize(num_groups_);
  for (int64_t g = 0; g < num_groups_; ++g) {
    const double* h = hypers.data() + g * kHypersPerGroup;
    groups_[g] = make_group_hyper(h[0], h[1], h[2], h[3], h[4], h[5] != 0,
                                  lr_tensors.empty() ? std::nullopt : lr_tensors[g], device_);
  }
  // The per-step scan: one pass over the parameters reading param.grad() directly. Checks run only
  // for grads that are new since the last step (a new TensorImpl or a new address).
  const int64_t n = static_cast<int64_t>(params_.size());
  int64_t created = 0;
  for (int64_t slot = 0; slot < n; ++slot) {
    const at::Tensor& p = params_[slot];
    c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    const void* pptr = p.const_data_ptr();
    if (pptr != param_ptr_[slot] || p.scalar_type() != param_dtype_[slot]) {  // param.data was replaced
      check_param(p, "parameter", slot);
      TORCH_CHECK(p.device() == device_, "AdamW: parameter ", slot, " moved to ", p.device(), " from ", device_);
      if (slots_[slot].initialized)
        TORCH_CHECK(p.scalar_type() == param_dtype_[slot], "AdamW: parameter ", slot, " changed dtype from ",
                    param_dtype_[slot], " to ", p.scalar_type(), " after its optimizer state was created");
      param_ptr_[slot] = pptr;
      param_dtype_[slot] = p.scalar_type();
      table_dirty_ = true;
    }
    const at::Tensor& g = impl->grad();
    const void* gptr = nullptr;
    if (g.defined()) {
      const c10::TensorImpl* gimpl = g.unsafeGetTensorImpl();
      gptr = g.layout() == at::kStrided ? g.const_data_ptr() : nullptr;
      if (gimpl != grad_impl_[slot] || gptr != grad_ptr_[slot] || gptr == nullptr) {
        check_grad(g, p, slot);
        grad_impl_[slot] = gimpl;
        if (!same_layout(g, p)) {  // rare: re-laid-out every step (never cached)
          relaid_.emplace_back(g, grad_in_param_layout(g, p));
          gptr = relaid_.back().second.const_data_ptr();
          grad_impl_[slot] = nullptr;
        }
      }
      if (!slots_[slot].initialized) {
        init_slot(slot);
        new_slots_.push_back(slot);
        ++created;
        table_dirty_ = true;
      }
      if (gptr == nullptr) gptr = p.numel() == 0 ? static_cast<const void*>(p.unsafeGetTensorImpl()) : gptr;
    } else {
      grad_impl_[slot] = nullptr;
    }
    grad_ptr_[slot] = gptr;
  }
  const bool table_changed = table_dirty_;
  if (table_dirty_) rebuild_table();
  grads_.resize(table_.size());
  for (size_t e = 0; e < table_.size(); ++e) grads_[e] = grad_ptr_[table_slot_[e]];
  StepWork work;
  work.table = &table_;
  work.plan = &plan_;
  work.table_changed = table_changed;
  work.groups = &groups_;
  work.grads = &grads_;
  work.grad_scale = optional_ptr(grad_scale);
  work.found_inf = optional_ptr(found_inf);
  work.device = device_;
  work.prefetch = prefetch_.empty() ? nullptr : &prefetch_;
  backend(cache_, work);
  table_dirty_ = false;
  if (!relaid_.empty()) {
    if (work.grad_scale) {
      for (auto& [grad, copy] : relaid_) grad.copy_(copy);
    }
    relaid_.clear();
  }
  return created;
}

void Handle::zero_grad(bool set_to_none) {
  std::vector<at::Tensor> to_zero;
  for (auto& p : params_) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g.reset();
    } else {
      if (g.grad_fn()) g = g.detach();
      g.requires_grad_(false);
      to_zero.push_back(g);
    }
  }
  if (!to_zero.empty()) at::_foreach_zero_(to_zero);
}

// ---- registry -----------------------------------------------------------------------------------

namespace {
std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<Handle>>& registry() {
  static auto* map = new std::unordered_map<int64_t, std::shared_ptr<Handle>>();  // outlives static destructors
  return *map;
}
int64_t next_id = 1;
}  // namespace

int64_t register_handle(std::shared_ptr<Handle> handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t id = next_id++;
  registry().emplace(id, std::move(handle));
  return id;
}

std::shared_ptr<Handle> get_handle(int64_t id, const at::Tensor& steps) {
  std::shared_ptr<Handle> h;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(id);
    TORCH_CHECK(it != registry().end(), "AdamW: no optimizer handle ", id, " (destroyed, or never created)");
    h = it->second;
  }
  // `steps` selects the backend; the handle updates its own counts (a copy of them, as opcheck passes, is
  // accepted but not written).
  TORCH_CHECK(steps.device() == h->device() && steps.numel() == h->steps().numel(), "AdamW: steps must be the ",
              h->steps().numel(), " step counts on ", h->device(), " that handle ", id, " was created with, got ",
              steps.numel(), " on ", steps.device());
  return h;
}

void destroy_handle(int64_t id) {
  std::shared_ptr<Handle> h;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(id);
    if (it == registry().end()) return;
    h = std::move(it->second);
    registry().erase(it);
  }
}

// ---- the tensor-list step -----------------------------------------------------------------------

void list_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList state_steps,
               at::TensorList exp_avg_absmaxs, at::TensorList exp_avg_sq_absmaxs, double lr,
               double beta1, double beta2, double weight_decay, double eps, bool maximize,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, BackendStepFn backend) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && state_steps.size() == n,
              "adamw_fused_: params, grads, exp_avgs, exp_avg_sqs and state_steps must have one entry per parameter (",
              n, "), got ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", state_steps.size());
  TORCH_CHECK(max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n,
              "adamw_fused_: max_exp_avg_sqs must be empty (no amsgrad) or hold one tensor per parameter (", n,
              "), got ", max_exp_avg_sqs.size());
  TORCH_CHECK(master_params.empty() || master_params.size() == n,
              "adamw_fused_: master_params must be empty or hold one tensor per parameter (", n, "), got ",
              master_params.size());
  TORCH_CHECK((exp_avg_absmaxs.empty() && exp_avg_sq_absmaxs.empty()) ||
                  (exp_avg_absmaxs.size() == n && exp_avg_sq_absmaxs.size() == n),
              "adamw_fused_: exp_avg_absmaxs and exp_avg_sq_absmaxs must both be empty (no int8 states) or hold one "
              "tensor per parameter (", n, "), got ", exp_avg_absmaxs.size(), " and ", exp_avg_sq_absmaxs.size());
  if (n == 0) return;
  const at::Device device = params[0].device();
  check_scale_tensor(grad_scale, "grad_scale", device);
  check_scale_tensor(found_inf, "found_inf", device);
  std::vector<GroupHyper> groups{make_group_hyper(lr, beta1, beta2, eps, weight_decay, maximize, lr_tensor, device)};
  std::vector<TensorMeta> table(n);
  std::vector<const void*> grad_ptrs(n);
  std::vector<int64_t> numels(n);
  std::vector<at::Tensor> relaid;
  relaid.reserve(n);
  auto check_state = [&](const at::Tensor& s, const at::Tensor& p, size_t i, const char* name,
                         at::ScalarType dt) {
    TORCH_CHECK(s.scalar_type() == dt && s.device() == device && same_layout(s, p), "adamw_fused_: ", name, "[", i,
                "] must be a ", dt, " tensor on ", device, " with the sizes and strides of params[", i, "] ", p.sizes(),
                ", got ", s.scalar_type(), " on ", s.device(), " with sizes ", s.sizes(), " and strides ", s.strides());
  };
  auto check_absmax = [&](const at::Tensor& a, const at::Tensor& p, size_t i, const char* name) {
    const int64_t blocks = quant_blocks(p.numel());
    // Longer arrays are allowed: a DTensor shard's scales are padded to one length on every rank.
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.device() == device && a.dim() == 1 && a.numel() >= blocks &&
                    a.is_contiguous(),
                "adamw_fused_: ", name, "[", i, "] must be a contiguous float32 vector on ", device, " of ", blocks,
                " block scales (one per ", kQuantBlock, " elements of params[", i, "]; more are not read), got ",
                a.scalar_type(), " on ", a.device(), " with sizes ", a.sizes());
  };
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_param(p, "params", static_cast<int64_t>(i));
    TORCH_CHECK(p.device() == device, "adamw_fused_: all tensors must be on one device; params[", i, "] is on ",
                p.device(), ", params[0] on ", device);
    check_grad(grads[i], p, static_cast<int64_t>(i));
    const at::Tensor& grad = relaid.emplace_back(grad_in_param_layout(grads[i], p));
    const auto full = state_dtype_of(p.scalar_type());
    // The format follows exp_avgs[i]'s dtype.
    const auto given = exp_avgs[i].scalar_type();
    const StateFormat format = p.scalar_type() == at::kDouble ? StateFormat::kFull
                               : given == at::kByte           ? StateFormat::kInt8
                               : given == at::kBFloat16       ? StateFormat::kBFloat16
                                                              : StateFormat::kFull;
    const auto moment = moment_dtype(format, p.scalar_type());
    check_state(exp_avgs[i], p, i, "exp_avgs", moment);
    check_state(exp_avg_sqs[i], p, i, "exp_avg_sqs", moment);
    if (!max_exp_avg_sqs.empty()) {
      TORCH_CHECK(format != StateFormat::kInt8, "adamw_fused_: amsgrad (max_exp_avg_sqs) is not supported with int8 "
                  "states (exp_avgs[", i, "] is uint8)");
      check_state(max_exp_avg_sqs[i], p, i, "max_exp_avg_sqs", moment);
    }
    const bool low = p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16;
    if (!master_params.empty() && low) check_state(master_params[i], p, i, "master_params", full);
    const at::Tensor& st = state_steps[i];
    TORCH_CHECK(st.scalar_type() == at::kFloat && st.numel() == 1 && st.device() == device, "adamw_fused_: state_steps[",
                i, "] must be one float32 value on ", device, ", got ", st.scalar_type(), " of shape ", st.sizes(),
                " on ", st.device());
    TensorMeta& m = table[i];
    m.param = p.data_ptr();
    m.exp_avg = exp_avgs[i].data_ptr();
    m.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    m.max_exp_avg_sq = max_exp_avg_sqs.empty() ? nullptr : max_exp_avg_sqs[i].data_ptr();
    m.master = (!master_params.empty() && low) ? master_params[i].data_ptr() : nullptr;
    if (format == StateFormat::kInt8) {
      TORCH_CHECK(!exp_avg_absmaxs.empty(), "adamw_fused_: exp_avgs[", i, "] holds int8 codes (uint8), so "
                  "exp_avg_absmaxs and exp_avg_sq_absmaxs must hold the block scales");
      check_absmax(exp_avg_absmaxs[i], p, i, "exp_avg_absmaxs");
      check_absmax(exp_avg_sq_absmaxs[i], p, i, "exp_avg_sq_absmaxs");
      m.exp_avg_absmax = exp_avg_absmaxs[i].mutable_data_ptr<float>();
      m.exp_avg_sq_absmax = exp_avg_sq_absmaxs[i].mutable_data_ptr<float>();
    }
    m.step = st.mutable_data_ptr<float>();
    m.numel = p.numel();
    m.dtype = static_cast<int32_t>(param_dtype_of(p.scalar_type()));
    m.state_format = static_cast<int32_t>(format);
    numels[i] = m.numel;
    // An empty grad has no storage address; any non-null marker says "has a grad".
    grad_ptrs[i] = grad.numel() ? grad.const_data_ptr() : static_cast<const void*>(&table[i]);
  }
  const BlockPlan plan = plan_blocks(numels);
  for (size_t i = 0; i < n; ++i) table[i].num_chunks = plan.num_chunks[i];
  StepWork work;
  work.table = &table;
  work.plan = &plan;
  work.table_changed = true;
  work.groups = &groups;
  work.grads = &grad_ptrs;
  work.grad_scale = optional_ptr(grad_scale);
  work.found_inf = optional_ptr(found_inf);
  work.device = device;
  std::shared_ptr<BackendCache> cache;
  backend(cache, work);
  if (grad_scale.has_value() && grad_scale->defined())
    for (size_t i = 0; i < n; ++i)
      if (!relaid[i].is_same(grads[i])) grads[i].copy_(relaid[i]);
}

// ---- CPU backend --------------------------------------------------------------------------------

namespace {

template <typename T, typename M, bool kAmsgrad>
void cpu_update_chunk(const TensorMeta& t, T* grad, int64_t begin, int64_t n, const StepScalars<M>& s) {
  T* p = static_cast<T*>(t.param) + begin;
  T* g = grad + begin;
  M* m = static_cast<M*>(t.exp_avg) + begin;
  M* v = static_cast<M*>(t.exp_avg_sq) + begin;
  M* vmax = kAmsgrad ? static_cast<M*>(t.max_exp_avg_sq) + begin : nullptr;
  M* master = t.master ? static_cast<M*>(t.master) + begin : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    M pv = master ? master[i] : static_cast<M>(p[i]);
    M gv = static_cast<M>(g[i]);
    M mv = m[i], vv = v[i];
    M vm = kAmsgrad ? vmax[i] : M(0);
    adamw_element<M, kAmsgrad>(pv, gv, mv, vv, vm, s);
    if (master) master[i] = pv;
    p[i] = static_cast<T>(pv);
    if (s.unscale) g[i] = static_cast<T>(gv);
    m[i] = mv;
    v[i] = vv;
    if constexpr (kAmsgrad) vmax[i] = vm;
  }
}

template <typename T, typename M>
void cpu_block(const TensorMeta& t, const GroupHyper& h, const void* grad, int64_t chunk, int64_t chunk_elems,
               const float* grad_scale) {
  double lr = h.lr;
  if (h.lr_ptr) lr = h.lr_is_double ? *static_cast<const double*>(h.lr_ptr) : *static_cast<const float*>(h.lr_ptr);
  const double step = static_cast<double>(*t.step + 1.0f);
  const auto s = make_step_scalars<M>(lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.maximize != 0, step, grad_scale);
  const int64_t begin = chunk * chunk_elems;
  const int64_t n = std::max<int64_t>(0, std::min(chunk_elems, t.numel - begin));
  if (n == 0) return;
  T* g = static_cast<T*>(const_cast<void*>(grad));
  if constexpr (std::is_same_v<M, float>) {
    FUSEFORGE_CPU_ISA_CALL(update_chunk, t, g, begin, n, s);  // vectorized, per ISA (adamw_cpu.h)
    return;
  }
  if (t.max_exp_avg_sq)
    cpu_update_chunk<T, M, true>(t, g, begin, n, s);
  else
    cpu_update_chunk<T, M, false>(t, g, begin, n, s);
}

}  // namespace

void cpu_step(std::shared_ptr<BackendCache>& /*cache*/, const StepWork& work) {
  if (work.found_inf && *work.found_inf != 0.f) return;  // GradScaler found inf/nan: the step changes nothing
  const auto& table = *work.table;
  const auto& blocks = work.plan->blocks;
  const auto& grads = *work.grads;
  const auto& groups = *work.groups;
  // Blocks read their tensor's step; the counts advance after every block has run.
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const BlockWork w = blocks[b];
      const void* grad = grads[w.tensor];
      if (grad == nullptr) continue;
      const TensorMeta& t = table[w.tensor];
      const GroupHyper& h = groups[t.group];
      switch (static_cast<ParamDtype>(t.dtype)) {
        case ParamDtype::kFloat: cpu_block<float, float>(t, h, grad, w.chunk, work.plan->chunk_elems, work.grad_scale); break;
        case ParamDtype::kHalf: cpu_block<at::Half, float>(t, h, grad, w.chunk, work.plan->chunk_elems, work.grad_scale); break;
        case ParamDtype::kBFloat16:
          cpu_block<at::BFloat16, float>(t, h, grad, w.chunk, work.plan->chunk_elems, work.grad_scale);
          break;
        case ParamDtype::kDouble: cpu_block<double, double>(t, h, grad, w.chunk, work.plan->chunk_elems, work.grad_scale); break;
      }
    }
  });
  for (size_t e = 0; e < table.size(); ++e)
    if (grads[e] != nullptr) *table[e].step += 1.0f;
}

// ---- op entry points ----------------------------------------------------------------------------

namespace {

// Tensor[] holds no None: an absent state travels as an empty bool CPU tensor (states are never bool).
at::Tensor absent_marker() { return at::empty({0}, at::TensorOptions().dtype(at::kBool)); }
bool is_absent_marker(const at::Tensor& t) { return !t.defined() || t.scalar_type() == at::kBool; }

int64_t handle_create(at::TensorList params, at::IntArrayRef groups, at::IntArrayRef flags, const at::Tensor& steps,
                      int64_t num_groups) {
  auto h = std::make_shared<Handle>(params.vec(), groups.vec(), flags.vec(), steps, num_groups);
  return register_handle(std::move(h));
}

std::vector<int64_t> handle_new_slots(int64_t id, const at::Tensor& steps) { return get_handle(id, steps)->take_new_slots(); }

std::vector<at::Tensor> handle_state(int64_t id, const at::Tensor& steps, int64_t slot) {
  auto out = get_handle(id, steps)->slot_state(slot);
  for (auto& t : out)
    if (!t.defined()) t = absent_marker();
  return out;
}

std::vector<at::Tensor> handle_set_state(int64_t id, const at::Tensor& steps, int64_t slot, at::TensorList states) {
  std::vector<at::Tensor> in;
  for (const auto& t : states) in.push_back(is_absent_marker(t) ? at::Tensor() : t);
  auto out = get_handle(id, steps)->set_slot_state(slot, in);
  for (auto& t : out)
    if (!t.defined()) t = absent_marker();
  return out;
}

void handle_zero_grad(int64_t id, const at::Tensor& steps, bool set_to_none) {
  get_handle(id, steps)->zero_grad(set_to_none);
}

void handle_destroy(int64_t id, const at::Tensor& /*steps*/) { destroy_handle(id); }

bool is_managed(const at::Tensor& t) {
  const ManagedMemory* memory = managed_memory();
  return t.is_cuda() && t.numel() > 0 && memory != nullptr && memory->is_managed(t.const_data_ptr());
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CompositeExplicitAutograd, m) {
  m.impl("adamw_handle_create", &handle_create);
  m.impl("adamw_handle_new_slots", &handle_new_slots);
  m.impl("adamw_handle_state", &handle_state);
  m.impl("adamw_handle_set_state", &handle_set_state);
  m.impl("adamw_handle_zero_grad", &handle_zero_grad);
  m.impl("adamw_handle_destroy", &handle_destroy);
  m.impl("adamw_is_managed", &is_managed);
}

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("adamw_handle_step", &handle_step_op<cpu_step>);
  m.impl("adamw_fused_", &fused_op<cpu_step>);
}

}  // namespace fuseforge::adamw
