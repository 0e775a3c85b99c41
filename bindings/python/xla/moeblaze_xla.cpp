// libmoeblaze_xla: XLA FFI handlers that run moeblaze's experts and whole-layer passes inside a
// JAX/XLA program (moeblaze/jax.py registers them with jax.ffi.register_ffi_target).
//
// Every handler checks the buffers XLA hands it (ranks, shapes, dtypes) against each other, finds
// or creates the layer plan of its configuration and calls the C API on XLA's stream (CUDA) or
// synchronously (CPU). The saved buffer is an output of the forward and an input of the backward;
// the workspace is an extra uint8 output that XLA allocates and drops after the call, so nothing
// here allocates device memory or waits for the device.
//
// Copyright (c) 2026 the moeblaze authors. SPDX-License-Identifier: Apache-2.0

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#if MOEBLAZE_XLA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "moeblaze.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define MOEBLAZE_XLA_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---- layer plans, one per (backend, device, configuration) --------------------------------------

struct LayerKey {
  int32_t backend = MOEBLAZE_BACKEND_CPU;
  int32_t device = 0;
  int32_t dtype = 0;
  int64_t d_model = 0, d_ffn = 0, num_experts = 0, top_k = 0;
  int32_t activation = 0, checkpoint = 0, score_function = 0, renormalize = 0;
  float aux_loss_coeff = 0.0f, z_loss_coeff = 0.0f;

  bool operator==(const LayerKey& o) const {
    return backend == o.backend && device == o.device && dtype == o.dtype && d_model == o.d_model &&
           d_ffn == o.d_ffn && num_experts == o.num_experts && top_k == o.top_k &&
           activation == o.activation && checkpoint == o.checkpoint &&
           score_function == o.score_function && renormalize == o.renormalize &&
           aux_loss_coeff == o.aux_loss_coeff && z_loss_coeff == o.z_loss_coeff;
  }
};

struct LayerKeyHash {
  size_t operator()(const LayerKey& k) const {
    size_t h = 0;
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    for (int64_t v : {int64_t(k.backend), int64_t(k.device), int64_t(k.dtype), k.d_model, k.d_ffn,
                      k.num_experts, k.top_k, int64_t(k.activation), int64_t(k.checkpoint),
                      int64_t(k.score_function), int64_t(k.renormalize)}) {
      mix(std::hash<int64_t>()(v));
    }
    mix(std::hash<float>()(k.aux_loss_coeff));
    mix(std::hash<float>()(k.z_loss_coeff));
    return h;
  }
};

// The message of the calling thread's last failed moeblaze call, or the status name.
std::string last_error(moeblaze_status_t status) {
  std::string message = moeblaze_last_error();
  if (message.empty()) message = moeblaze_status_name(status);
  return message;
}

ffi::ErrorCode error_code(moeblaze_status_t status) {
  switch (status) {
    case MOEBLAZE_ERR_INVALID_ARGUMENT:
    case MOEBLAZE_ERR_NON_FINITE: return ffi::ErrorCode::kInvalidArgument;
    case MOEBLAZE_ERR_NOT_SUPPORTED: return ffi::ErrorCode::kUnimplemented;
    case MOEBLAZE_ERR_OUT_OF_MEMORY: return ffi::ErrorCode::kResourceExhausted;
    case MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE:
    case MOEBLAZE_ERR_VERSION_MISMATCH: return ffi::ErrorCode::kFailedPrecondition;
    default: return ffi::ErrorCode::kInternal;
  }
}

ffi::Error status_error(const char* target, moeblaze_status_t status) {
  return ffi::Error(error_code(status), std::string(target) + ": " + last_error(status));
}

// Contexts and layer plans live for the whole process: XLA may run a handler from any thread until
// exit, and destroying CUDA objects during static destruction races the CUDA runtime's own
// teardown. The cache is therefore allocated once and never freed.
class PlanCache {
 public:
  // The plan of `key`, created on first use. Thread-safe; creation happens once per key.
  moeblaze_status_t get(const LayerKey& key, moeblaze_layer_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = layers_.find(key);
    if (found != layers_.end()) {
      *out = found->second;
      return MOEBLAZE_OK;
    }
    moeblaze_context_t context = nullptr;
    auto device = std::make_pair(key.backend, key.device);
    auto context_found = contexts_.find(device);
    if (context_found != contexts_.end()) {
      context = context_found->second;
    } else {
      moeblaze_status_t status = moeblaze_context_create(&context, key.backend, key.device);
      if (status != MOEBLAZE_OK) return status;
      contexts_.emplace(device, context);
    }
    moeblaze_layer_config_t config;
    moeblaze_status_t status = moeblaze_layer_config_init(&config, sizeof config);
    if (status != MOEBLAZE_OK) return status;
    config.dtype = key.dtype;
    config.d_model = key.d_model;
    config.d_ffn = key.d_ffn;
    config.num_experts = key.num_experts;
    config.top_k = key.top_k;
    config.activation = key.activation;
    config.checkpoint = key.checkpoint;
    config.score_function = key.score_function;
    config.renormalize = key.renormalize;
    config.aux_loss_coeff = key.aux_loss_coeff;
    config.z_loss_coeff = key.z_loss_coeff;
    moeblaze_layer_t layer = nullptr;
    status = moeblaze_layer_create(&layer, context, &config);
    if (status != MOEBLAZE_OK) return status;
    layers_.emplace(key, layer);
    *out = layer;
    return MOEBLAZE_OK;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<int32_t, int32_t>, moeblaze_context_t> contexts_;
  std::unordered_map<LayerKey, moeblaze_layer_t, LayerKeyHash> layers_;
};

PlanCache& plans() {
  static PlanCache* cache = new PlanCache();
  return *cache;
}

// ---- buffer checks ------------------------------------------------------------------------------

// Where a handler runs: the backend, its device ordinal and the stream (NULL on the CPU).
struct Where {
  int32_t backend;
  int32_t device;
  void* stream;
};

std::string shape_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

const char* dtype_name(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::U8: return "uint8";
    default: return "an unsupported dtype";
  }
}

// Checks one buffer: dtype and shape. Builds the message only on failure.
class Checker {
 public:
  explicit Checker(const char* target) : target_(target) {}

  bool ok() const { return message_.empty(); }
  ffi::Error error() const {
    return ok() ? ffi::Error::Success() : ffi::Error::InvalidArgument(message_);
  }

  void expect(const ffi::AnyBuffer& buffer, const char* name, ffi::DataType type,
              std::initializer_list<int64_t> shape) {
    if (!ok()) return;
    if (buffer.element_type() != type) {
      fail(name, std::string("expected dtype ") + dtype_name(type) + ", got " +
                     dtype_name(buffer.element_type()));
      return;
    }
    auto dims = buffer.dimensions();
    bool same = dims.size() == shape.size();
    size_t i = 0;
    for (int64_t extent : shape) {
      if (!same) break;
      same = dims[i++] == extent;
    }
    if (!same) {
      std::string want = "[";
      i = 0;
      for (int64_t extent : shape) want += (i++ ? ", " : "") + std::to_string(extent);
      fail(name, "expected shape " + want + "], got " + shape_string(dims));
    }
  }

  // An unused operand or result (w_up of a non-gated activation): must hold no elements.
  void expect_empty(const ffi::AnyBuffer& buffer, const char* name, const char* why) {
    if (ok() && buffer.element_count() != 0) {
      fail(name, std::string("must be empty (") + why + "), got shape " +
                     shape_string(buffer.dimensions()));
    }
  }

  // A byte buffer (saved, workspace): rank-1 uint8.
  void expect_bytes(const ffi::AnyBuffer& buffer, const char* name) {
    if (ok() && (buffer.element_type() != ffi::DataType::U8 || buffer.dimensions().size() != 1)) {
      fail(name, std::string("expected a rank-1 uint8 buffer, got ") +
                     dtype_name(buffer.element_type()) + " " + shape_string(buffer.dimensions()));
    }
  }

  void fail(const char* name, const std::string& what) {
    message_ = std::string(target_) + ": " + name + ": " + what;
  }

 private:
  const char* target_;
  std::string message_;
};

bool storage_dtype(ffi::DataType type, int32_t* code) {
  switch (type) {
    case ffi::DataType::F32: *code = MOEBLAZE_DTYPE_F32; return true;
    case ffi::DataType::BF16: *code = MOEBLAZE_DTYPE_BF16; return true;
    case ffi::DataType::F16: *code = MOEBLAZE_DTYPE_F16; return true;
    case ffi::DataType::F64: *code = MOEBLAZE_DTYPE_F64; return true;
    default: return false;
  }
}

// logits, g, dg and the losses are F64 for F64 layers and F32 otherwise (moeblaze.h).
ffi::DataType routing_dtype(ffi::DataType storage) {
  return storage == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

bool gated(int32_t activation) {
  return activation == MOEBLAZE_ACTIVATION_SWIGLU || activation == MOEBLAZE_ACTIVATION_GEGLU ||
         activation == MOEBLAZE_ACTIVATION_REGLU;
}

// The shapes shared by every pass: x [T,d] and the expert weights; fills T, d, h, E and the dtype.
struct Shapes {
  int64_t T = 0, d = 0, h = 0, E = 0;
  ffi::DataType type = ffi::DataType::INVALID;
  int32_t dtype = 0;
};

ffi::Error read_shapes(const char* target, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w_gate,
                       Shapes* s) {
  s->type = x.element_type();
  if (!storage_dtype(s->type, &s->dtype)) {
    return ffi::Error::InvalidArgument(std::string(target) + ": x: dtype " + dtype_name(s->type) +
                                       " is not one of float32, bfloat16, float16, float64");
  }
  if (x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(std::string(target) + ": x: expected [T, d_model], got " +
                                       shape_string(x.dimensions()));
  }
  if (w_gate.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument(std::string(target) +
                                       ": w_gate: expected [E, d_ffn, d_model], got " +
                                       shape_string(w_gate.dimensions()));
  }
  s->T = x.dimensions()[0];
  s->d = x.dimensions()[1];
  s->E = w_gate.dimensions()[0];
  s->h = w_gate.dimensions()[1];
  return ffi::Error::Success();
}

// The weights every pass reads: w_gate, w_up (gated only, else empty), w_down.
void check_weights(Checker& check, const Shapes& s, int32_t activation,
                   const ffi::AnyBuffer& w_gate, const ffi::AnyBuffer& w_up,
                   const ffi::AnyBuffer& w_down) {
  check.expect(w_gate, "w_gate", s.type, {s.E, s.h, s.d});
  if (gated(activation)) {
    check.expect(w_up, "w_up", s.type, {s.E, s.h, s.d});
  } else {
    check.expect_empty(w_up, "w_up", "the activation is not gated");
  }
  check.expect(w_down, "w_down", s.type, {s.E, s.d, s.h});
}

void* data_or_null(const ffi::AnyBuffer& buffer) {
  return buffer.element_count() ? buffer.untyped_data() : nullptr;
}

ffi::Error find_plan(const char* target, const Where& where, const Shapes& s, int64_t top_k,
                     int32_t activation, int32_t checkpoint, int32_t score_function,
                     int32_t renormalize, float aux_loss_coeff, float z_loss_coeff,
                     moeblaze_layer_t* layer) {
  LayerKey key;
  key.backend = where.backend;
  key.device = where.device;
  key.dtype = s.dtype;
  key.d_model = s.d;
  key.d_ffn = s.h;
  key.num_experts = s.E;
  key.top_k = top_k;
  key.activation = activation;
  key.checkpoint = checkpoint;
  key.score_function = score_function;
  key.renormalize = renormalize;
  key.aux_loss_coeff = aux_loss_coeff;
  key.z_loss_coeff = z_loss_coeff;
  moeblaze_status_t status = plans().get(key, layer);
  return status == MOEBLAZE_OK ? ffi::Error::Success() : status_error(target, status);
}

// With MOEBLAZE_BACKWARD_CONSUME_SAVED the backward overwrites the saved activations. XLA allows
// that only because the saved operand is aliased to the `saved_out` result (input_output_aliases);
// a handler that finds them apart refuses rather than write into a buffer XLA considers immutable.
ffi::Error backward_flags(const char* target, int32_t consume_saved, const ffi::AnyBuffer& saved,
                          const ffi::AnyBuffer& saved_out, uint32_t* flags) {
  *flags = 0;
  if (!consume_saved) return ffi::Error::Success();
  if (saved.untyped_data() != saved_out.untyped_data()) {
    return ffi::Error::Internal(std::string(target) +
                                ": consume_saved = 1 but XLA did not alias saved to saved_out");
  }
  *flags = MOEBLAZE_BACKWARD_CONSUME_SAVED;
  return ffi::Error::Success();
}

// ---- experts: given ids and g -------------------------------------------------------------------

constexpr const char* kExpertsForward = "moeblaze_experts_fwd";
constexpr const char* kExpertsBackward = "moeblaze_experts_bwd";
constexpr const char* kLayerForward = "moeblaze_layer_fwd";
constexpr const char* kLayerBackward = "moeblaze_layer_bwd";

// y = experts(x, ids, g); saved (empty for inference) and workspace are byte buffers sized by
// moeblaze_layer_saved_size / moeblaze_layer_workspace_size(_with_flags) of the same plan.
ffi::Error experts_forward(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                           ffi::AnyBuffer g, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                           ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> saved, ffi::Result<ffi::AnyBuffer> workspace,
                           int32_t activation, int32_t checkpoint) {
  const char* target = kExpertsForward;
  Shapes s;
  if (ffi::Error e = read_shapes(target, x, w_gate, &s); e.failure()) return e;
  Checker check(target);
  if (ids.dimensions().size() != 2) {
    check.fail("ids", "expected [T, top_k], got " + shape_string(ids.dimensions()));
    return check.error();
  }
  const int64_t k = ids.dimensions()[1];
  check.expect(ids, "ids", ffi::DataType::S32, {s.T, k});
  check.expect(g, "g", routing_dtype(s.type), {s.T, k});
  check_weights(check, s, activation, w_gate, w_up, w_down);
  check.expect(*y, "y", s.type, {s.T, s.d});
  check.expect_bytes(*saved, "saved");
  check.expect_bytes(*workspace, "workspace");
  if (!check.ok()) return check.error();

  moeblaze_layer_t layer = nullptr;
  if (ffi::Error e = find_plan(target, where, s, k, activation, checkpoint,
                               MOEBLAZE_SCORE_SOFTMAX_TOPK, 0, 0.0f, 0.0f, &layer);
      e.failure()) {
    return e;
  }
  moeblaze_forward_args_t args;
  moeblaze_forward_args_init(&args, sizeof args);
  args.num_tokens = s.T;
  args.x = data_or_null(x);
  args.ids = static_cast<const int32_t*>(data_or_null(ids));
  args.g = data_or_null(g);
  args.w_gate = w_gate.untyped_data();
  args.w_up = data_or_null(w_up);
  args.w_down = w_down.untyped_data();
  args.y = data_or_null(*y);
  args.saved = data_or_null(*saved);
  args.saved_bytes = saved->size_bytes();
  args.workspace = data_or_null(*workspace);
  args.workspace_bytes = workspace->size_bytes();
  moeblaze_status_t status = moeblaze_experts_forward(layer, &args, where.stream);
  return status == MOEBLAZE_OK ? ffi::Error::Success() : status_error(target, status);
}

// dx, dg, dw_gate, dw_up (empty for non-gated activations), dw_down from dy and the saved buffer.
// saved_out is saved itself (aliased); workspace is scratch.
ffi::Error experts_backward(const Where& where, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::AnyBuffer ids, ffi::AnyBuffer g, ffi::AnyBuffer w_gate,
                            ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer saved,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dg,
                            ffi::Result<ffi::AnyBuffer> dw_gate, ffi::Result<ffi::AnyBuffer> dw_up,
                            ffi::Result<ffi::AnyBuffer> dw_down,
                            ffi::Result<ffi::AnyBuffer> saved_out,
                            ffi::Result<ffi::AnyBuffer> workspace, int32_t activation,
                            int32_t checkpoint, int32_t consume_saved) {
  const char* target = kExpertsBackward;
  Shapes s;
  if (ffi::Error e = read_shapes(target, x, w_gate, &s); e.failure()) return e;
  Checker check(target);
  if (ids.dimensions().size() != 2) {
    check.fail("ids", "expected [T, top_k], got " + shape_string(ids.dimensions()));
    return check.error();
  }
  const int64_t k = ids.dimensions()[1];
  const ffi::DataType rtype = routing_dtype(s.type);
  check.expect(dy, "dy", s.type, {s.T, s.d});
  check.expect(ids, "ids", ffi::DataType::S32, {s.T, k});
  check.expect(g, "g", rtype, {s.T, k});
  check_weights(check, s, activation, w_gate, w_up, w_down);
  check.expect_bytes(saved, "saved");
  check.expect(*dx, "dx", s.type, {s.T, s.d});
  check.expect(*dg, "dg", rtype, {s.T, k});
  check_weights(check, s, activation, *dw_gate, *dw_up, *dw_down);
  check.expect_bytes(*saved_out, "saved_out");
  check.expect_bytes(*workspace, "workspace");
  if (!check.ok()) return check.error();

  uint32_t flags = 0;
  if (ffi::Error e = backward_flags(target, consume_saved, saved, *saved_out, &flags);
      e.failure()) {
    return e;
  }
  moeblaze_layer_t layer = nullptr;
  if (ffi::Error e = find_plan(target, where, s, k, activation, checkpoint,
                               MOEBLAZE_SCORE_SOFTMAX_TOPK, 0, 0.0f, 0.0f, &layer);
      e.failure()) {
    return e;
  }
  moeblaze_backward_args_t args;
  moeblaze_backward_args_init(&args, sizeof args);
  args.flags = flags;
  args.num_tokens = s.T;
  args.dy = data_or_null(dy);
  args.x = data_or_null(x);
  args.ids = static_cast<const int32_t*>(data_or_null(ids));
  args.g = data_or_null(g);
  args.w_gate = w_gate.untyped_data();
  args.w_up = data_or_null(w_up);
  args.w_down = w_down.untyped_data();
  args.saved = saved.untyped_data();
  args.saved_bytes = saved.size_bytes();
  args.dx = data_or_null(*dx);
  args.dg = data_or_null(*dg);
  args.dw_gate = dw_gate->untyped_data();
  args.dw_up = data_or_null(*dw_up);
  args.dw_down = dw_down->untyped_data();
  args.workspace = data_or_null(*workspace);
  args.workspace_bytes = workspace->size_bytes();
  moeblaze_status_t status = moeblaze_experts_backward(layer, &args, where.stream);
  return status == MOEBLAZE_OK ? ffi::Error::Success() : status_error(target, status);
}

// ---- whole layer: router projection, router, experts --------------------------------------------

// y, losses [2] = {aux, z}, expert_counts [E] int32 from x and every weight.
ffi::Error layer_forward(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer w_router,
                         ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> losses,
                         ffi::Result<ffi::AnyBuffer> expert_counts,
                         ffi::Result<ffi::AnyBuffer> saved, ffi::Result<ffi::AnyBuffer> workspace,
                         int64_t top_k, int32_t activation, int32_t checkpoint,
                         int32_t score_function, int32_t renormalize, float aux_loss_coeff,
                         float z_loss_coeff) {
  const char* target = kLayerForward;
  Shapes s;
  if (ffi::Error e = read_shapes(target, x, w_gate, &s); e.failure()) return e;
  Checker check(target);
  check.expect(w_router, "w_router", s.type, {s.E, s.d});
  check_weights(check, s, activation, w_gate, w_up, w_down);
  check.expect(*y, "y", s.type, {s.T, s.d});
  check.expect(*losses, "losses", routing_dtype(s.type), {2});
  check.expect(*expert_counts, "expert_counts", ffi::DataType::S32, {s.E});
  check.expect_bytes(*saved, "saved");
  check.expect_bytes(*workspace, "workspace");
  if (!check.ok()) return check.error();

  moeblaze_layer_t layer = nullptr;
  if (ffi::Error e = find_plan(target, where, s, top_k, activation, checkpoint, score_function,
                               renormalize, aux_loss_coeff, z_loss_coeff, &layer);
      e.failure()) {
    return e;
  }
  moeblaze_forward_args_t args;
  moeblaze_forward_args_init(&args, sizeof args);
  args.num_tokens = s.T;
  args.x = data_or_null(x);
  args.w_router = w_router.untyped_data();
  args.w_gate = w_gate.untyped_data();
  args.w_up = data_or_null(w_up);
  args.w_down = w_down.untyped_data();
  args.y = data_or_null(*y);
  args.losses = losses->untyped_data();
  args.expert_counts = static_cast<int32_t*>(expert_counts->untyped_data());
  args.saved = data_or_null(*saved);
  args.saved_bytes = saved->size_bytes();
  args.workspace = data_or_null(*workspace);
  args.workspace_bytes = workspace->size_bytes();
  moeblaze_status_t status = moeblaze_layer_forward(layer, &args, where.stream);
  return status == MOEBLAZE_OK ? ffi::Error::Success() : status_error(target, status);
}

// dx, dw_router, dw_gate, dw_up, dw_down from dy, d_losses [2] and the saved buffer.
ffi::Error layer_backward(const Where& where, ffi::AnyBuffer dy, ffi::AnyBuffer d_losses,
                          ffi::AnyBuffer x, ffi::AnyBuffer w_router, ffi::AnyBuffer w_gate,
                          ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer saved,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw_router,
                          ffi::Result<ffi::AnyBuffer> dw_gate, ffi::Result<ffi::AnyBuffer> dw_up,
                          ffi::Result<ffi::AnyBuffer> dw_down,
                          ffi::Result<ffi::AnyBuffer> saved_out,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t top_k, int32_t activation,
                          int32_t checkpoint, int32_t score_function, int32_t renormalize,
                          float aux_loss_coeff, float z_loss_coeff, int32_t consume_saved) {
  const char* target = kLayerBackward;
  Shapes s;
  if (ffi::Error e = read_shapes(target, x, w_gate, &s); e.failure()) return e;
  Checker check(target);
  check.expect(dy, "dy", s.type, {s.T, s.d});
  check.expect(d_losses, "d_losses", routing_dtype(s.type), {2});
  check.expect(w_router, "w_router", s.type, {s.E, s.d});
  check_weights(check, s, activation, w_gate, w_up, w_down);
  check.expect_bytes(saved, "saved");
  check.expect(*dx, "dx", s.type, {s.T, s.d});
  check.expect(*dw_router, "dw_router", s.type, {s.E, s.d});
  check_weights(check, s, activation, *dw_gate, *dw_up, *dw_down);
  check.expect_bytes(*saved_out, "saved_out");
  check.expect_bytes(*workspace, "workspace");
  if (!check.ok()) return check.error();

  uint32_t flags = 0;
  if (ffi::Error e = backward_flags(target, consume_saved, saved, *saved_out, &flags);
      e.failure()) {
    return e;
  }
  moeblaze_layer_t layer = nullptr;
  if (ffi::Error e = find_plan(target, where, s, top_k, activation, checkpoint, score_function,
                               renormalize, aux_loss_coeff, z_loss_coeff, &layer);
      e.failure()) {
    return e;
  }
  moeblaze_backward_args_t args;
  moeblaze_backward_args_init(&args, sizeof args);
  args.flags = flags;
  args.num_tokens = s.T;
  args.dy = data_or_null(dy);
  args.d_losses = d_losses.untyped_data();
  args.x = data_or_null(x);
  args.w_router = w_router.untyped_data();
  args.w_gate = w_gate.untyped_data();
  args.w_up = data_or_null(w_up);
  args.w_down = w_down.untyped_data();
  args.saved = saved.untyped_data();
  args.saved_bytes = saved.size_bytes();
  args.dx = data_or_null(*dx);
  args.dw_router = dw_router->untyped_data();
  args.dw_gate = dw_gate->untyped_data();
  args.dw_up = data_or_null(*dw_up);
  args.dw_down = dw_down->untyped_data();
  args.workspace = data_or_null(*workspace);
  args.workspace_bytes = workspace->size_bytes();
  moeblaze_status_t status = moeblaze_layer_backward(layer, &args, where.stream);
  return status == MOEBLAZE_OK ? ffi::Error::Success() : status_error(target, status);
}

}  // namespace

// The binding of each target after its platform contexts (none on the CPU; stream and device
// ordinal on CUDA). Attribute names match the keyword arguments moeblaze/jax.py passes.
#define MOEBLAZE_XLA_EXPERTS_FORWARD(binding) \
  binding                                     \
      .Arg<ffi::AnyBuffer>() /* x */          \
      .Arg<ffi::AnyBuffer>() /* ids */        \
      .Arg<ffi::AnyBuffer>() /* g */          \
      .Arg<ffi::AnyBuffer>() /* w_gate */     \
      .Arg<ffi::AnyBuffer>() /* w_up */       \
      .Arg<ffi::AnyBuffer>() /* w_down */     \
      .Ret<ffi::AnyBuffer>() /* y */          \
      .Ret<ffi::AnyBuffer>() /* saved */      \
      .Ret<ffi::AnyBuffer>() /* workspace */  \
      .Attr<int32_t>("activation")            \
      .Attr<int32_t>("checkpoint")

#define MOEBLAZE_XLA_EXPERTS_BACKWARD(binding)               \
  binding                                                    \
      .Arg<ffi::AnyBuffer>() /* dy */                        \
      .Arg<ffi::AnyBuffer>() /* x */                         \
      .Arg<ffi::AnyBuffer>() /* ids */                       \
      .Arg<ffi::AnyBuffer>() /* g */                         \
      .Arg<ffi::AnyBuffer>() /* w_gate */                    \
      .Arg<ffi::AnyBuffer>() /* w_up */                      \
      .Arg<ffi::AnyBuffer>() /* w_down */                    \
      .Arg<ffi::AnyBuffer>() /* saved */                     \
      .Ret<ffi::AnyBuffer>() /* dx */                        \
      .Ret<ffi::AnyBuffer>() /* dg */                        \
      .Ret<ffi::AnyBuffer>() /* dw_gate */                   \
      .Ret<ffi::AnyBuffer>() /* dw_up */                     \
      .Ret<ffi::AnyBuffer>() /* dw_down */                   \
      .Ret<ffi::AnyBuffer>() /* saved_out (aliases saved) */ \
      .Ret<ffi::AnyBuffer>() /* workspace */                 \
      .Attr<int32_t>("activation")                           \
      .Attr<int32_t>("checkpoint")                           \
      .Attr<int32_t>("consume_saved")

#define MOEBLAZE_XLA_LAYER_ATTRS(binding) \
  binding.Attr<int64_t>("top_k")          \
      .Attr<int32_t>("activation")        \
      .Attr<int32_t>("checkpoint")        \
      .Attr<int32_t>("score_function")    \
      .Attr<int32_t>("renormalize")       \
      .Attr<float>("aux_loss_coeff")      \
      .Attr<float>("z_loss_coeff")

#define MOEBLAZE_XLA_LAYER_FORWARD(binding)                               \
  MOEBLAZE_XLA_LAYER_ATTRS(binding                                        \
                               .Arg<ffi::AnyBuffer>() /* x */             \
                               .Arg<ffi::AnyBuffer>() /* w_router */      \
                               .Arg<ffi::AnyBuffer>() /* w_gate */        \
                               .Arg<ffi::AnyBuffer>() /* w_up */          \
                               .Arg<ffi::AnyBuffer>() /* w_down */        \
                               .Ret<ffi::AnyBuffer>() /* y */             \
                               .Ret<ffi::AnyBuffer>() /* losses */        \
                               .Ret<ffi::AnyBuffer>() /* expert_counts */ \
                               .Ret<ffi::AnyBuffer>() /* saved */         \
                               .Ret<ffi::AnyBuffer>() /* workspace */)

#define MOEBLAZE_XLA_LAYER_BACKWARD(binding)                                          \
  MOEBLAZE_XLA_LAYER_ATTRS(binding                                                    \
                               .Arg<ffi::AnyBuffer>() /* dy */                        \
                               .Arg<ffi::AnyBuffer>() /* d_losses */                  \
                               .Arg<ffi::AnyBuffer>() /* x */                         \
                               .Arg<ffi::AnyBuffer>() /* w_router */                  \
                               .Arg<ffi::AnyBuffer>() /* w_gate */                    \
                               .Arg<ffi::AnyBuffer>() /* w_up */                      \
                               .Arg<ffi::AnyBuffer>() /* w_down */                    \
                               .Arg<ffi::AnyBuffer>() /* saved */                     \
                               .Ret<ffi::AnyBuffer>() /* dx */                        \
                               .Ret<ffi::AnyBuffer>() /* dw_router */                 \
                               .Ret<ffi::AnyBuffer>() /* dw_gate */                   \
                               .Ret<ffi::AnyBuffer>() /* dw_up */                     \
                               .Ret<ffi::AnyBuffer>() /* dw_down */                   \
                               .Ret<ffi::AnyBuffer>() /* saved_out (aliases saved) */ \
                               .Ret<ffi::AnyBuffer>() /* workspace */)                \
      .Attr<int32_t>("consume_saved")

// ---- CPU handlers: synchronous, device 0 --------------------------------------------------------

#define MOEBLAZE_XLA_CPU_HANDLER(symbol, impl, BINDING)                     \
  MOEBLAZE_XLA_EXPORT XLA_FFI_Error* symbol(XLA_FFI_CallFrame* call_frame); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      symbol,                                                               \
      [](auto... args) {                                                    \
        return impl(Where{MOEBLAZE_BACKEND_CPU, 0, nullptr}, args...);      \
      },                                                                    \
      BINDING(ffi::Ffi::Bind()))

MOEBLAZE_XLA_CPU_HANDLER(MoeblazeXlaExpertsForwardCpu, experts_forward,
                         MOEBLAZE_XLA_EXPERTS_FORWARD);
MOEBLAZE_XLA_CPU_HANDLER(MoeblazeXlaExpertsBackwardCpu, experts_backward,
                         MOEBLAZE_XLA_EXPERTS_BACKWARD);
MOEBLAZE_XLA_CPU_HANDLER(MoeblazeXlaLayerForwardCpu, layer_forward, MOEBLAZE_XLA_LAYER_FORWARD);
MOEBLAZE_XLA_CPU_HANDLER(MoeblazeXlaLayerBackwardCpu, layer_backward, MOEBLAZE_XLA_LAYER_BACKWARD);

// ---- CUDA handlers: XLA's stream and device -----------------------------------------------------

#if MOEBLAZE_XLA_WITH_CUDA
#define MOEBLAZE_XLA_CUDA_HANDLER(symbol, impl, BINDING)                                        \
  MOEBLAZE_XLA_EXPORT XLA_FFI_Error* symbol(XLA_FFI_CallFrame* call_frame);                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                \
      symbol,                                                                                   \
      [](cudaStream_t stream, int32_t device, auto... args) {                                   \
        return impl(Where{MOEBLAZE_BACKEND_CUDA, device, static_cast<void*>(stream)}, args...); \
      },                                                                                        \
      BINDING(                                                                                  \
          ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()))

MOEBLAZE_XLA_CUDA_HANDLER(MoeblazeXlaExpertsForwardCuda, experts_forward,
                          MOEBLAZE_XLA_EXPERTS_FORWARD);
MOEBLAZE_XLA_CUDA_HANDLER(MoeblazeXlaExpertsBackwardCuda, experts_backward,
                          MOEBLAZE_XLA_EXPERTS_BACKWARD);
MOEBLAZE_XLA_CUDA_HANDLER(MoeblazeXlaLayerForwardCuda, layer_forward, MOEBLAZE_XLA_LAYER_FORWARD);
MOEBLAZE_XLA_CUDA_HANDLER(MoeblazeXlaLayerBackwardCuda, layer_backward,
                          MOEBLAZE_XLA_LAYER_BACKWARD);
#endif

// 1 when the CUDA handlers are compiled in (moeblaze/jax.py registers them only then).
MOEBLAZE_XLA_EXPORT int32_t MoeblazeXlaHasCuda(void) {
  return MOEBLAZE_XLA_WITH_CUDA ? 1 : 0;
}

// The moeblaze ABI version this shim was compiled against.
MOEBLAZE_XLA_EXPORT int32_t MoeblazeXlaAbiVersion(void) {
  return MOEBLAZE_ABI_VERSION;
}
