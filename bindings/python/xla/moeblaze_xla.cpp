// libmoeblaze_xla: XLA FFI handlers that run moeblaze's experts and whole-layer passes inside a
// JAX/XLA program (moeblaze/jax.py registers them with jax.ffi.register_ffi_target).
//
// Every handler finds or creates the layer plan of its configuration (a bounded cache), checks the
// buffers XLA hands it (ranks, shapes, dtypes) against each other and the plan, and calls the C API
// on XLA's stream (CUDA) or synchronously (CPU). The saved buffer is an output of the forward and
// an input of the backward; the workspace is an extra uint8 output that XLA allocates and drops
// after the call, so nothing here allocates device memory or waits for the device.
//
// Copyright (c) 2026 the moeblaze authors. SPDX-License-Identifier: Apache-2.0

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if MOEBLAZE_XLA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "moeblaze.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define MOEBLAZE_XLA_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---- layer plans, one per (backend, device, configuration) --------------------------------------

// A plan's key: where it runs and the configuration it is created with. Equality and the hash read
// every field a handler may set; the others keep the defaults of moeblaze_layer_config_init().
struct LayerKey {
  int32_t backend = MOEBLAZE_BACKEND_CPU;
  int32_t device = 0;
  moeblaze_layer_config_t config{};

  bool operator==(const LayerKey& o) const {
    const moeblaze_layer_config_t &a = config, &b = o.config;
    return backend == o.backend && device == o.device && a.dtype == b.dtype &&
           a.d_model == b.d_model && a.d_ffn == b.d_ffn && a.num_experts == b.num_experts &&
           a.top_k == b.top_k && a.activation == b.activation && a.checkpoint == b.checkpoint &&
           a.score_function == b.score_function && a.renormalize == b.renormalize &&
           a.aux_loss_coeff == b.aux_loss_coeff && a.z_loss_coeff == b.z_loss_coeff;
  }
};

struct LayerKeyHash {
  size_t operator()(const LayerKey& k) const {
    const moeblaze_layer_config_t& c = k.config;
    size_t h = 0;
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    for (int64_t v : {int64_t(k.backend), int64_t(k.device), int64_t(c.dtype), c.d_model, c.d_ffn,
                      c.num_experts, c.top_k, int64_t(c.activation), int64_t(c.checkpoint),
                      int64_t(c.score_function), int64_t(c.renormalize)}) {
      mix(std::hash<int64_t>()(v));
    }
    mix(std::hash<float>()(c.aux_loss_coeff));
    mix(std::hash<float>()(c.z_loss_coeff));
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

// The FFI result of a C API call: success, or its error prefixed with the target's name.
ffi::Error call_result(const char* target, moeblaze_status_t status) {
  if (status == MOEBLAZE_OK) return ffi::Error::Success();
  return ffi::Error(error_code(status), std::string(target) + ": " + last_error(status));
}

// A layer plan, destroyed when the cache has evicted it and no handler holds it any more.
class Plan {
 public:
  explicit Plan(moeblaze_layer_t layer) : layer_(layer) {}
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() { moeblaze_layer_destroy(layer_); }  // resets this thread's last error: see forward()
  moeblaze_layer_t get() const { return layer_; }

 private:
  moeblaze_layer_t layer_;
};

// The plans most recently used, at most kMaxPlans: the loss coefficients are part of a plan's
// configuration, so a run that anneals one would otherwise add a plan per value, for good.
// Handlers find their plan by key at every call (compiled programs hold no plan), so an evicted
// plan is simply made again when used again. A handler holds its plan (shared_ptr) until the call
// returns; a CUDA plan may then go while its kernels run, since a layer owns no device memory and
// its kernels take the plan's values as arguments (as moeblaze.torch's evicted plans do).
// Contexts, one per (backend, device), live for the whole process: XLA may run a handler from any
// thread until exit, and destroying CUDA objects during static destruction races the CUDA
// runtime's own teardown. The cache is therefore allocated once and never freed.
class PlanCache {
 public:
  static constexpr size_t kMaxPlans = 256;

  // The plan of `key`, created on first use. Thread-safe; a key has at most one cached plan.
  moeblaze_status_t get(const LayerKey& key, std::shared_ptr<const Plan>* out) {
    std::vector<std::shared_ptr<const Plan>> evicted;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = index_.find(key);
    if (found != index_.end()) {
      order_.splice(order_.begin(), order_, found->second);  // now the most recently used
      *out = found->second->second;
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
    moeblaze_layer_t layer = nullptr;
    moeblaze_status_t status = moeblaze_layer_create(&layer, context, &key.config);
    if (status != MOEBLAZE_OK) return status;
    order_.emplace_front(key, std::make_shared<const Plan>(layer));
    index_.emplace(key, order_.begin());
    while (order_.size() > kMaxPlans) {
      index_.erase(order_.back().first);
      evicted.push_back(std::move(order_.back().second));
      order_.pop_back();
    }
    *out = order_.front().second;
    return MOEBLAZE_OK;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return order_.size();
  }

 private:
  using Entry = std::pair<LayerKey, std::shared_ptr<const Plan>>;

  std::mutex mutex_;
  std::map<std::pair<int32_t, int32_t>, moeblaze_context_t> contexts_;
  std::list<Entry> order_;  // most recently used first
  std::unordered_map<LayerKey, std::list<Entry>::iterator, LayerKeyHash> index_;
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
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "another dtype";
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

// The operands that a forward reads and its backward reads again. The experts targets are given
// the routing (ids, g); the layer targets compute it from w_router. The other kind's are null.
struct Inputs {
  const ffi::AnyBuffer* x;
  const ffi::AnyBuffer* ids;       // experts targets only
  const ffi::AnyBuffer* g;         // experts targets only
  const ffi::AnyBuffer* w_router;  // layer targets only
  const ffi::AnyBuffer* w_gate;
  const ffi::AnyBuffer* w_up;
  const ffi::AnyBuffer* w_down;

  static Inputs experts(const ffi::AnyBuffer& x, const ffi::AnyBuffer& ids, const ffi::AnyBuffer& g,
                        const ffi::AnyBuffer& w_gate, const ffi::AnyBuffer& w_up,
                        const ffi::AnyBuffer& w_down) {
    return {&x, &ids, &g, nullptr, &w_gate, &w_up, &w_down};
  }
  static Inputs layer(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w_router,
                      const ffi::AnyBuffer& w_gate, const ffi::AnyBuffer& w_up,
                      const ffi::AnyBuffer& w_down) {
    return {&x, nullptr, nullptr, &w_router, &w_gate, &w_up, &w_down};
  }
};

// The gradients a backward writes, one per input but ids (which has none); null where the input is.
struct Gradients {
  ffi::AnyBuffer* dx;
  ffi::AnyBuffer* dg;         // experts targets only
  ffi::AnyBuffer* dw_router;  // layer targets only
  ffi::AnyBuffer* dw_gate;
  ffi::AnyBuffer* dw_up;
  ffi::AnyBuffer* dw_down;

  static Gradients experts(ffi::AnyBuffer& dx, ffi::AnyBuffer& dg, ffi::AnyBuffer& dw_gate,
                           ffi::AnyBuffer& dw_up, ffi::AnyBuffer& dw_down) {
    return {&dx, &dg, nullptr, &dw_gate, &dw_up, &dw_down};
  }
  static Gradients layer(ffi::AnyBuffer& dx, ffi::AnyBuffer& dw_router, ffi::AnyBuffer& dw_gate,
                         ffi::AnyBuffer& dw_up, ffi::AnyBuffer& dw_down) {
    return {&dx, nullptr, &dw_router, &dw_gate, &dw_up, &dw_down};
  }
};

// The shapes every other buffer is checked against: T, d from x [T, d]; E, h from w_gate
// [E, h, d]; k from ids [T, k] (experts targets) or the top_k attribute (layer targets).
struct Shapes {
  int64_t T = 0, d = 0, h = 0, E = 0, k = 0;
  ffi::DataType type = ffi::DataType::INVALID;
  int32_t dtype = 0;
};

ffi::Error read_shapes(const char* target, const Inputs& in, int64_t top_k, Shapes* s) {
  const ffi::AnyBuffer& x = *in.x;
  const ffi::AnyBuffer& w_gate = *in.w_gate;
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
  s->k = top_k;
  if (in.ids) {
    if (in.ids->dimensions().size() != 2) {
      return ffi::Error::InvalidArgument(std::string(target) + ": ids: expected [T, top_k], got " +
                                         shape_string(in.ids->dimensions()));
    }
    s->k = in.ids->dimensions()[1];
  }
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

// The inputs but x, which read_shapes() has checked: the routing operands, then the weights.
void check_inputs(Checker& check, const Shapes& s, int32_t activation, const Inputs& in) {
  if (in.ids) {
    check.expect(*in.ids, "ids", ffi::DataType::S32, {s.T, s.k});
    check.expect(*in.g, "g", routing_dtype(s.type), {s.T, s.k});
  }
  if (in.w_router) check.expect(*in.w_router, "w_router", s.type, {s.E, s.d});
  check_weights(check, s, activation, *in.w_gate, *in.w_up, *in.w_down);
}

// The buffer's data; NULL for a buffer the target does not have.
void* data(const ffi::AnyBuffer* buffer) {
  return buffer ? buffer->untyped_data() : nullptr;
}

// As data(), and NULL for an empty buffer too (T = 0, w_up of a non-gated activation, the saved
// buffer of an inference forward).
void* data_or_null(const ffi::AnyBuffer* buffer) {
  return buffer && buffer->element_count() ? buffer->untyped_data() : nullptr;
}

// The fields of the inputs, named alike in moeblaze_forward_args_t and moeblaze_backward_args_t.
template <typename Args>
void fill_inputs(const Inputs& in, Args* args) {
  args->x = data_or_null(in.x);
  args->ids = static_cast<const int32_t*>(data_or_null(in.ids));
  args->g = data_or_null(in.g);
  args->w_router = data(in.w_router);
  args->w_gate = in.w_gate->untyped_data();
  args->w_up = data_or_null(in.w_up);
  args->w_down = in.w_down->untyped_data();
}

// A plan key holding a call's attributes; find_plan() adds where it runs and the shapes. The
// experts targets route nothing, so the router's fields keep their defaults (softmax_topk, no
// renormalisation, no losses).
LayerKey experts_key(int32_t activation, int32_t checkpoint) {
  LayerKey key;
  moeblaze_layer_config_init(&key.config, sizeof key.config);  // cannot fail: its own size
  key.config.activation = activation;
  key.config.checkpoint = checkpoint;
  return key;
}

LayerKey layer_key(int64_t top_k, int32_t activation, int32_t checkpoint, int32_t score_function,
                   int32_t renormalize, float aux_loss_coeff, float z_loss_coeff) {
  LayerKey key = experts_key(activation, checkpoint);
  key.config.top_k = top_k;
  key.config.score_function = score_function;
  key.config.renormalize = renormalize;
  key.config.aux_loss_coeff = aux_loss_coeff;
  key.config.z_loss_coeff = z_loss_coeff;
  return key;
}

ffi::Error find_plan(const char* target, const Where& where, const Shapes& s, LayerKey key,
                     std::shared_ptr<const Plan>* plan) {
  key.backend = where.backend;
  key.device = where.device;
  key.config.dtype = s.dtype;
  key.config.d_model = s.d;
  key.config.d_ffn = s.h;
  key.config.num_experts = s.E;
  key.config.top_k = s.k;
  return call_result(target, plans().get(key, plan));
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

// ---- the two pass bodies, shared by the experts and the layer targets ---------------------------

// moeblaze_experts_forward or moeblaze_layer_forward: the same arguments, and so for the backward.
using ForwardPass = moeblaze_status_t (*)(moeblaze_layer_t, const moeblaze_forward_args_t*, void*);
using BackwardPass = moeblaze_status_t (*)(moeblaze_layer_t, const moeblaze_backward_args_t*,
                                           void*);

// Checks the buffers, finds the plan of `key` and runs `pass`. losses and expert_counts are the
// layer targets' (null for the experts targets); saved is empty for an inference forward.
ffi::Error forward(const char* target, ForwardPass pass, const Where& where, const LayerKey& key,
                   const Inputs& in, ffi::AnyBuffer& y, ffi::AnyBuffer* losses,
                   ffi::AnyBuffer* expert_counts, ffi::AnyBuffer& saved,
                   ffi::AnyBuffer& workspace) {
  Shapes s;
  if (ffi::Error e = read_shapes(target, in, key.config.top_k, &s); e.failure()) return e;
  // The plan first: creating it validates the attributes, which the buffer checks rely on.
  std::shared_ptr<const Plan> plan;
  if (ffi::Error e = find_plan(target, where, s, key, &plan); e.failure()) return e;
  Checker check(target);
  check_inputs(check, s, key.config.activation, in);
  check.expect(y, "y", s.type, {s.T, s.d});
  if (losses) check.expect(*losses, "losses", routing_dtype(s.type), {2});
  if (expert_counts) check.expect(*expert_counts, "expert_counts", ffi::DataType::S32, {s.E});
  check.expect_bytes(saved, "saved");
  check.expect_bytes(workspace, "workspace");
  if (!check.ok()) return check.error();

  moeblaze_forward_args_t args;
  moeblaze_forward_args_init(&args, sizeof args);
  args.num_tokens = s.T;
  fill_inputs(in, &args);
  args.y = data_or_null(&y);
  args.losses = data(losses);
  args.expert_counts = static_cast<int32_t*>(data(expert_counts));
  args.saved = data_or_null(&saved);
  args.saved_bytes = saved.size_bytes();
  args.workspace = data_or_null(&workspace);
  args.workspace_bytes = workspace.size_bytes();
  // call_result() reads the error message before `plan` is released, whose destruction (if the
  // cache has evicted it meanwhile) would reset this thread's last error.
  return call_result(target, pass(plan->get(), &args, where.stream));
}

// As forward(), from the cotangents dy and d_losses (the layer targets', else null) and the saved
// buffer of the forward; saved_out is saved itself when consume_saved aliases them.
ffi::Error backward(const char* target, BackwardPass pass, const Where& where, const LayerKey& key,
                    int32_t consume_saved, const ffi::AnyBuffer& dy, const ffi::AnyBuffer* d_losses,
                    const Inputs& in, const ffi::AnyBuffer& saved, const Gradients& grad,
                    ffi::AnyBuffer& saved_out, ffi::AnyBuffer& workspace) {
  Shapes s;
  if (ffi::Error e = read_shapes(target, in, key.config.top_k, &s); e.failure()) return e;
  std::shared_ptr<const Plan> plan;  // first, as in forward()
  if (ffi::Error e = find_plan(target, where, s, key, &plan); e.failure()) return e;
  Checker check(target);
  check.expect(dy, "dy", s.type, {s.T, s.d});
  if (d_losses) check.expect(*d_losses, "d_losses", routing_dtype(s.type), {2});
  check_inputs(check, s, key.config.activation, in);
  check.expect_bytes(saved, "saved");
  check.expect(*grad.dx, "dx", s.type, {s.T, s.d});
  if (grad.dg) check.expect(*grad.dg, "dg", routing_dtype(s.type), {s.T, s.k});
  if (grad.dw_router) check.expect(*grad.dw_router, "dw_router", s.type, {s.E, s.d});
  check_weights(check, s, key.config.activation, *grad.dw_gate, *grad.dw_up, *grad.dw_down);
  check.expect_bytes(saved_out, "saved_out");
  check.expect_bytes(workspace, "workspace");
  if (!check.ok()) return check.error();

  uint32_t flags = 0;
  if (ffi::Error e = backward_flags(target, consume_saved, saved, saved_out, &flags); e.failure()) {
    return e;
  }
  moeblaze_backward_args_t args;
  moeblaze_backward_args_init(&args, sizeof args);
  args.flags = flags;
  args.num_tokens = s.T;
  args.dy = data_or_null(&dy);
  args.d_losses = data(d_losses);
  fill_inputs(in, &args);
  args.saved = saved.untyped_data();
  args.saved_bytes = saved.size_bytes();
  args.dx = data_or_null(grad.dx);
  args.dg = data_or_null(grad.dg);
  args.dw_router = data(grad.dw_router);
  args.dw_gate = grad.dw_gate->untyped_data();
  args.dw_up = data_or_null(grad.dw_up);
  args.dw_down = grad.dw_down->untyped_data();
  args.workspace = data_or_null(&workspace);
  args.workspace_bytes = workspace.size_bytes();
  return call_result(target, pass(plan->get(), &args, where.stream));  // as in forward()
}

// ---- the four targets ---------------------------------------------------------------------------

// An operand and a result of a target, as the FFI hands them (an `Arg` and a `Ret` of the binding).
using Arg = ffi::AnyBuffer;
using Ret = ffi::Result<ffi::AnyBuffer>;

// y = experts(x, ids, g); saved (empty for inference) and workspace are byte buffers sized by
// moeblaze_layer_saved_size / moeblaze_layer_workspace_size(_with_flags) of the same plan.
ffi::Error experts_forward(const Where& where, Arg x, Arg ids, Arg g, Arg w_gate, Arg w_up,
                           Arg w_down, Ret y, Ret saved, Ret workspace, int32_t activation,
                           int32_t checkpoint) {
  return forward("moeblaze_experts_fwd", moeblaze_experts_forward, where,
                 experts_key(activation, checkpoint),
                 Inputs::experts(x, ids, g, w_gate, w_up, w_down), *y, /*losses=*/nullptr,
                 /*expert_counts=*/nullptr, *saved, *workspace);
}

// dx, dg, dw_gate, dw_up (empty for non-gated activations), dw_down from dy and the saved buffer.
// saved_out is saved itself (aliased); workspace is scratch.
ffi::Error experts_backward(const Where& where, Arg dy, Arg x, Arg ids, Arg g, Arg w_gate, Arg w_up,
                            Arg w_down, Arg saved, Ret dx, Ret dg, Ret dw_gate, Ret dw_up,
                            Ret dw_down, Ret saved_out, Ret workspace, int32_t activation,
                            int32_t checkpoint, int32_t consume_saved) {
  return backward("moeblaze_experts_bwd", moeblaze_experts_backward, where,
                  experts_key(activation, checkpoint), consume_saved, dy, /*d_losses=*/nullptr,
                  Inputs::experts(x, ids, g, w_gate, w_up, w_down), saved,
                  Gradients::experts(*dx, *dg, *dw_gate, *dw_up, *dw_down), *saved_out, *workspace);
}

// y, losses [2] = {aux, z}, expert_counts [E] int32 from x and every weight.
ffi::Error layer_forward(const Where& where, Arg x, Arg w_router, Arg w_gate, Arg w_up, Arg w_down,
                         Ret y, Ret losses, Ret expert_counts, Ret saved, Ret workspace,
                         int64_t top_k, int32_t activation, int32_t checkpoint,
                         int32_t score_function, int32_t renormalize, float aux_loss_coeff,
                         float z_loss_coeff) {
  return forward("moeblaze_layer_fwd", moeblaze_layer_forward, where,
                 layer_key(top_k, activation, checkpoint, score_function, renormalize,
                           aux_loss_coeff, z_loss_coeff),
                 Inputs::layer(x, w_router, w_gate, w_up, w_down), *y, &*losses, &*expert_counts,
                 *saved, *workspace);
}

// dx, dw_router, dw_gate, dw_up, dw_down from dy, d_losses [2] and the saved buffer.
ffi::Error layer_backward(const Where& where, Arg dy, Arg d_losses, Arg x, Arg w_router, Arg w_gate,
                          Arg w_up, Arg w_down, Arg saved, Ret dx, Ret dw_router, Ret dw_gate,
                          Ret dw_up, Ret dw_down, Ret saved_out, Ret workspace, int64_t top_k,
                          int32_t activation, int32_t checkpoint, int32_t score_function,
                          int32_t renormalize, float aux_loss_coeff, float z_loss_coeff,
                          int32_t consume_saved) {
  return backward("moeblaze_layer_bwd", moeblaze_layer_backward, where,
                  layer_key(top_k, activation, checkpoint, score_function, renormalize,
                            aux_loss_coeff, z_loss_coeff),
                  consume_saved, dy, &d_losses, Inputs::layer(x, w_router, w_gate, w_up, w_down),
                  saved, Gradients::layer(*dx, *dw_router, *dw_gate, *dw_up, *dw_down), *saved_out,
                  *workspace);
}

// `binding` followed by n operands (Arg), then m >= 1 results (Ret). A Binding can only be passed
// on as a temporary, so every step returns the next one directly.
template <int n, int m, typename Binding>
auto buffers(Binding binding) {
  static_assert(m >= 1, "every target has a result");
  if constexpr (n > 0) {
    return buffers<n - 1, m>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (m > 1) {
    return buffers<0, m - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Ret<ffi::AnyBuffer>();
  }
}

}  // namespace

// The binding of each target after its platform contexts (none on the CPU; stream and device
// ordinal on CUDA): the operands and results in the order of its function's parameters above, then
// the attributes, whose names match the keyword arguments moeblaze/jax.py passes.
#define MOEBLAZE_XLA_EXPERTS_ATTRS(binding) \
  binding.Attr<int32_t>("activation").Attr<int32_t>("checkpoint")

#define MOEBLAZE_XLA_LAYER_ATTRS(binding) \
  binding.Attr<int64_t>("top_k")          \
      .Attr<int32_t>("activation")        \
      .Attr<int32_t>("checkpoint")        \
      .Attr<int32_t>("score_function")    \
      .Attr<int32_t>("renormalize")       \
      .Attr<float>("aux_loss_coeff")      \
      .Attr<float>("z_loss_coeff")

#define MOEBLAZE_XLA_EXPERTS_FORWARD(binding) MOEBLAZE_XLA_EXPERTS_ATTRS((buffers<6, 3>(binding)))
#define MOEBLAZE_XLA_EXPERTS_BACKWARD(binding) \
  MOEBLAZE_XLA_EXPERTS_ATTRS((buffers<8, 7>(binding))).Attr<int32_t>("consume_saved")
#define MOEBLAZE_XLA_LAYER_FORWARD(binding) MOEBLAZE_XLA_LAYER_ATTRS((buffers<5, 5>(binding)))
#define MOEBLAZE_XLA_LAYER_BACKWARD(binding) \
  MOEBLAZE_XLA_LAYER_ATTRS((buffers<8, 7>(binding))).Attr<int32_t>("consume_saved")

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

// How many layer plans the handlers' cache holds now, and at most (tests and diagnostics).
MOEBLAZE_XLA_EXPORT int64_t MoeblazeXlaCachedPlans(void) {
  return static_cast<int64_t>(plans().size());
}

MOEBLAZE_XLA_EXPORT int64_t MoeblazeXlaMaxCachedPlans(void) {
  return static_cast<int64_t>(PlanCache::kMaxPlans);
}

// The moeblaze ABI version this shim was compiled against.
MOEBLAZE_XLA_EXPORT int32_t MoeblazeXlaAbiVersion(void) {
  return MOEBLAZE_ABI_VERSION;
}
