#include "api/layer_composite.hpp"

#include <algorithm>
#include <mutex>

#include "common/carver.hpp"
#include "common/checks.hpp"
#include "common/saved_layout.hpp"

namespace moeblaze {
namespace api {

namespace {

// Scratch the whole-layer calls carve for themselves before the largest sub-call's workspace.
struct LayerForwardScratch {
  // Inference only (no saved buffer); a training forward writes them into `saved` and carves none.
  void* logits = nullptr;  // [T,E] rtype
  int32_t* ids = nullptr;  // [T,k]
  void* g = nullptr;       // [T,k] rtype
  Buffer sub;              // workspace for the sub-calls, one at a time
};

struct LayerBackwardScratch {
  void* dg = nullptr;        // [T,k] rtype
  void* d_logits = nullptr;  // [T,E] rtype (unless the caller asked for d_logits)
  Buffer sub;
};

size_t max_sub_workspace(const Backend& backend, const LayerDesc& desc, int64_t T,
                         uint32_t backward_flags, std::initializer_list<Pass> passes) {
  size_t largest = 0;
  for (Pass p : passes) {
    largest = std::max(largest, backend.workspace_size(desc, p, T, backward_flags));
  }
  return largest;
}

// with_saved: the layout of a training forward (MOEBLAZE_FORWARD_WITH_SAVED), which the size
// query and the call both derive from it.
LayerForwardScratch carve_layer_forward(Carver& c, const Backend& backend, const LayerDesc& desc,
                                        int64_t T, bool with_saved) {
  LayerForwardScratch s;
  if (!with_saved) {
    s.logits = c.carve(desc.relem_size() * size_t(T * desc.E));
    s.ids = c.carve<int32_t>(sizeof(int32_t) * size_t(T * desc.k));
    s.g = c.carve(desc.relem_size() * size_t(T * desc.k));
  }
  const size_t sub =
      max_sub_workspace(backend, desc, T, with_saved ? MOEBLAZE_FORWARD_WITH_SAVED : 0u,
                        {Pass::RouterProjectForward, Pass::RouterForward, Pass::ExpertsForward});
  s.sub = {c.carve(sub), sub};
  return s;
}

LayerBackwardScratch carve_layer_backward(Carver& c, const Backend& backend, const LayerDesc& desc,
                                          int64_t T, uint32_t flags) {
  LayerBackwardScratch s;
  s.dg = c.carve(desc.relem_size() * size_t(T * desc.k));
  s.d_logits = c.carve(desc.relem_size() * size_t(T * desc.E));
  const size_t sub =
      max_sub_workspace(backend, desc, T, flags,
                        {Pass::ExpertsBackward, Pass::RouterBackward, Pass::RouterProjectBackward});
  s.sub = {c.carve(sub), sub};
  return s;
}

const char* query_name(Pass pass, uint32_t flags = 0) {
  const bool consume = (flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0;
  const bool with_saved = (flags & MOEBLAZE_FORWARD_WITH_SAVED) != 0;
  switch (pass) {
    case Pass::ExpertsForward:
      return with_saved ? "moeblaze_layer_workspace_size_with_flags(MOEBLAZE_PASS_EXPERTS_FORWARD, "
                          "MOEBLAZE_FORWARD_WITH_SAVED)"
                        : "moeblaze_layer_workspace_size(MOEBLAZE_PASS_EXPERTS_FORWARD)";
    case Pass::ExpertsBackward:
      return consume ? "moeblaze_layer_workspace_size_with_flags(MOEBLAZE_PASS_EXPERTS_BACKWARD, "
                       "flags)"
                     : "moeblaze_layer_workspace_size(MOEBLAZE_PASS_EXPERTS_BACKWARD)";
    case Pass::LayerForward:
      return with_saved ? "moeblaze_layer_workspace_size_with_flags(MOEBLAZE_PASS_LAYER_FORWARD, "
                          "MOEBLAZE_FORWARD_WITH_SAVED)"
                        : "moeblaze_layer_workspace_size(MOEBLAZE_PASS_LAYER_FORWARD)";
    case Pass::LayerBackward:
      return consume ? "moeblaze_layer_workspace_size_with_flags(MOEBLAZE_PASS_LAYER_BACKWARD, "
                       "flags)"
                     : "moeblaze_layer_workspace_size(MOEBLAZE_PASS_LAYER_BACKWARD)";
    default: return "moeblaze_layer_workspace_size";
  }
}

}  // namespace

size_t workspace_size_for(const LayerState& layer, Pass pass, int64_t T, uint32_t flags) {
  const Backend& backend = *layer.context->backend;
  Carver measure;
  switch (pass) {
    case Pass::LayerForward:
      carve_layer_forward(measure, backend, layer.desc, T,
                          (flags & MOEBLAZE_FORWARD_WITH_SAVED) != 0);
      break;
    case Pass::LayerBackward: carve_layer_backward(measure, backend, layer.desc, T, flags); break;
    default: return backend.workspace_size(layer.desc, pass, T, flags);
  }
  return measure.size();
}

void run_forward(LayerState& layer, const moeblaze_forward_args_t& a, Pass pass, void* stream) {
  const LayerDesc& desc = layer.desc;
  Backend& backend = *layer.context->backend;
  const bool whole_layer = pass == Pass::LayerForward;
  const int64_t T = a.num_tokens;

  MB_REQUIRE_ARG(a.flags == 0, "args->flags = %u must be 0 (reserved)", a.flags);
  require_num_tokens(desc, T, "args->num_tokens");
  const bool empty = T == 0;
  const size_t es = desc.elem_size();
  const size_t rs = desc.relem_size();
  require_tensor(backend, a.x, true, empty, es, "args->x");
  require_tensor(backend, a.w_gate, true, false, es, "args->w_gate");
  require_tensor(backend, a.w_up, desc.gated(), false, es, "args->w_up");
  require_tensor(backend, a.w_down, true, false, es, "args->w_down");
  require_tensor(backend, a.y, true, empty, es, "args->y");
  require_tensor(backend, a.expert_counts, false, false, sizeof(int32_t), "args->expert_counts");
  if (whole_layer) {
    require_tensor(backend, a.w_router, true, false, es, "args->w_router");
    require_tensor(backend, a.logits_out, false, false, rs, "args->logits_out");
    require_tensor(backend, a.ids_out, false, false, sizeof(int32_t), "args->ids_out");
    require_tensor(backend, a.g_out, false, false, rs, "args->g_out");
    require_tensor(backend, a.losses, false, false, rs, "args->losses");
  } else {
    require_tensor(backend, a.ids, true, empty, sizeof(int32_t), "args->ids");
    require_tensor(backend, a.g, true, empty, rs, "args->g");
  }
  const bool training = a.saved != nullptr;
  if (training) {
    require_buffer(backend, a.saved, a.saved_bytes, saved_size(desc, pass, T), "args->saved",
                   "args->saved_bytes",
                   whole_layer ? "moeblaze_layer_saved_size(MOEBLAZE_PASS_LAYER_FORWARD)"
                               : "moeblaze_layer_saved_size(MOEBLAZE_PASS_EXPERTS_FORWARD)");
  }
  // A training forward writes its routing, router outputs and (SAVE_ALL) u into `saved`, so it
  // needs only the MOEBLAZE_FORWARD_WITH_SAVED size; the plain size is larger and also accepted.
  const uint32_t ws_flags = training ? MOEBLAZE_FORWARD_WITH_SAVED : 0u;
  const size_t ws_needed = workspace_size_for(layer, pass, T, ws_flags);
  require_buffer(backend, a.workspace, a.workspace_bytes, ws_needed, "args->workspace",
                 "args->workspace_bytes", query_name(pass, ws_flags));
  {
    const size_t Tn = size_t(T), d = size_t(desc.d), h = size_t(desc.h), E = size_t(desc.E),
                 k = size_t(desc.k);
    const auto layer_only = [&](const void* p) { return whole_layer ? p : nullptr; };
    const auto experts_only = [&](const void* p) { return whole_layer ? nullptr : p; };
    require_disjoint({
        {a.x, Tn * d * es, false, "args->x"},
        {a.w_gate, E * h * d * es, false, "args->w_gate"},
        {desc.gated() ? a.w_up : nullptr, E * h * d * es, false, "args->w_up"},
        {a.w_down, E * d * h * es, false, "args->w_down"},
        {layer_only(a.w_router), E * d * es, false, "args->w_router"},
        {experts_only(a.ids), Tn * k * sizeof(int32_t), false, "args->ids"},
        {experts_only(a.g), Tn * k * rs, false, "args->g"},
        {a.y, Tn * d * es, true, "args->y"},
        {a.expert_counts, E * sizeof(int32_t), true, "args->expert_counts"},
        {layer_only(a.logits_out), Tn * E * rs, true, "args->logits_out"},
        {layer_only(a.ids_out), Tn * k * sizeof(int32_t), true, "args->ids_out"},
        {layer_only(a.g_out), Tn * k * rs, true, "args->g_out"},
        {layer_only(a.losses), 2 * rs, true, "args->losses"},
        {a.saved, a.saved_bytes, true, "args->saved"},
        {a.workspace, a.workspace_bytes, true, "args->workspace"},
    });
  }

  ExpertsForwardCall experts;
  experts.T = T;
  experts.x = a.x;
  experts.w_gate = a.w_gate;
  experts.w_up = desc.gated() ? a.w_up : nullptr;
  experts.w_down = a.w_down;
  experts.y = a.y;
  experts.stream = stream;
  experts.saved_pass = whole_layer ? Pass::LayerForward : Pass::ExpertsForward;
  if (training) {
    Carver saved_carver(a.saved);
    experts.saved = carve_saved(saved_carver, desc, experts.saved_pass, T);
    experts.has_saved = true;
  }

  std::lock_guard<std::mutex> lock(layer.context->execute_mutex);
  if (!whole_layer) {
    experts.ids = a.ids;
    experts.g = a.g;
    experts.expert_counts = a.expert_counts;
    experts.workspace = {a.workspace, a.workspace_bytes};
    backend.experts_forward(desc, experts);
    return;
  }

  // Whole layer: logits, ids and g go to the saved buffer when training (backward needs them), to
  // the workspace otherwise.
  Carver ws_carver(a.workspace);
  LayerForwardScratch scratch = carve_layer_forward(ws_carver, backend, desc, T, training);
  void* logits = training ? experts.saved.logits : scratch.logits;
  int32_t* ids = training ? experts.saved.ids : scratch.ids;
  void* g = training ? experts.saved.g : scratch.g;

  RouterProjectForwardCall project;
  project.T = T;
  project.x = a.x;
  project.w_router = a.w_router;
  project.logits = logits;
  project.workspace = scratch.sub;
  project.stream = stream;
  backend.router_project_forward(desc, project);

  RouterForwardCall route;
  route.T = T;
  route.logits = logits;
  route.ids = ids;
  route.g = g;
  route.expert_counts = a.expert_counts;
  route.losses = a.losses;
  route.workspace = scratch.sub;
  route.stream = stream;
  backend.router_forward(desc, route);

  experts.ids = ids;
  experts.g = g;
  experts.expert_counts = nullptr;  // counted by the router already
  experts.workspace = scratch.sub;
  backend.experts_forward(desc, experts);

  if (a.logits_out) backend.copy(a.logits_out, logits, rs * size_t(T * desc.E), stream);
  if (a.ids_out) backend.copy(a.ids_out, ids, sizeof(int32_t) * size_t(T * desc.k), stream);
  if (a.g_out) backend.copy(a.g_out, g, rs * size_t(T * desc.k), stream);
}

void run_backward(LayerState& layer, const moeblaze_backward_args_t& a, Pass pass, void* stream) {
  const LayerDesc& desc = layer.desc;
  Backend& backend = *layer.context->backend;
  const bool whole_layer = pass == Pass::LayerBackward;
  const Pass forward_pass = whole_layer ? Pass::LayerForward : Pass::ExpertsForward;
  const int64_t T = a.num_tokens;

  require_backward_flags(a.flags, "args->flags");
  require_num_tokens(desc, T, "args->num_tokens");
  const bool empty = T == 0;
  const size_t es = desc.elem_size();
  const size_t rs = desc.relem_size();
  require_tensor(backend, a.dy, true, empty, es, "args->dy");
  require_tensor(backend, a.x, true, empty, es, "args->x");
  require_tensor(backend, a.w_gate, true, false, es, "args->w_gate");
  require_tensor(backend, a.w_up, desc.gated(), false, es, "args->w_up");
  require_tensor(backend, a.w_down, true, false, es, "args->w_down");
  require_tensor(backend, a.dx, false, false, es, "args->dx");
  require_tensor(backend, a.dw_gate, false, false, es, "args->dw_gate");
  require_tensor(backend, a.dw_up, false, false, es, "args->dw_up");
  require_tensor(backend, a.dw_down, false, false, es, "args->dw_down");
  if (whole_layer) {
    require_tensor(backend, a.w_router, true, false, es, "args->w_router");
    require_tensor(backend, a.d_losses, false, false, rs, "args->d_losses");
    require_tensor(backend, a.dw_router, false, false, es, "args->dw_router");
    require_tensor(backend, a.d_logits, false, false, rs, "args->d_logits");
  } else {
    require_tensor(backend, a.ids, true, empty, sizeof(int32_t), "args->ids");
    require_tensor(backend, a.g, true, empty, rs, "args->g");
    require_tensor(backend, a.dg, false, false, rs, "args->dg");
  }
  MB_REQUIRE_ARG(a.saved != nullptr,
                 "args->saved is NULL: backward needs the saved buffer its forward pass filled");
  require_buffer(backend, a.saved, a.saved_bytes, saved_size(desc, forward_pass, T), "args->saved",
                 "args->saved_bytes",
                 whole_layer ? "moeblaze_layer_saved_size(MOEBLAZE_PASS_LAYER_FORWARD)"
                             : "moeblaze_layer_saved_size(MOEBLAZE_PASS_EXPERTS_FORWARD)");
  require_buffer(backend, a.workspace, a.workspace_bytes,
                 workspace_size_for(layer, pass, T, a.flags), "args->workspace",
                 "args->workspace_bytes", query_name(pass, a.flags));
  {
    const size_t Tn = size_t(T), d = size_t(desc.d), h = size_t(desc.h), E = size_t(desc.E),
                 k = size_t(desc.k);
    const auto layer_only = [&](const void* p) { return whole_layer ? p : nullptr; };
    const auto experts_only = [&](const void* p) { return whole_layer ? nullptr : p; };
    const bool gated = desc.gated();
    require_disjoint({
        {a.dy, Tn * d * es, false, "args->dy"},
        {a.x, Tn * d * es, false, "args->x"},
        {a.w_gate, E * h * d * es, false, "args->w_gate"},
        {gated ? a.w_up : nullptr, E * h * d * es, false, "args->w_up"},
        {a.w_down, E * d * h * es, false, "args->w_down"},
        {layer_only(a.w_router), E * d * es, false, "args->w_router"},
        {layer_only(a.d_losses), 2 * rs, false, "args->d_losses"},
        {experts_only(a.ids), Tn * k * sizeof(int32_t), false, "args->ids"},
        {experts_only(a.g), Tn * k * rs, false, "args->g"},
        {a.saved, a.saved_bytes, (a.flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0, "args->saved"},
        {a.dx, Tn * d * es, true, "args->dx"},
        {a.dw_gate, E * h * d * es, true, "args->dw_gate"},
        {gated ? a.dw_up : nullptr, E * h * d * es, true, "args->dw_up"},
        {a.dw_down, E * d * h * es, true, "args->dw_down"},
        {layer_only(a.dw_router), E * d * es, true, "args->dw_router"},
        {layer_only(a.d_logits), Tn * E * rs, true, "args->d_logits"},
        {experts_only(a.dg), Tn * k * rs, true, "args->dg"},
        {a.workspace, a.workspace_bytes, true, "args->workspace"},
    });
  }

  Carver saved_carver(const_cast<void*>(a.saved));
  ExpertsBackwardCall experts;
  experts.T = T;
  experts.dy = a.dy;
  experts.x = a.x;
  experts.w_gate = a.w_gate;
  experts.w_up = desc.gated() ? a.w_up : nullptr;
  experts.w_down = a.w_down;
  experts.saved = carve_saved(saved_carver, desc, forward_pass, T);
  experts.saved_pass = forward_pass;
  experts.dx = a.dx;
  experts.dw_gate = a.dw_gate;
  experts.dw_up = desc.gated() ? a.dw_up : nullptr;
  experts.dw_down = a.dw_down;
  experts.accumulate_wgrad = (a.flags & MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD) != 0;
  experts.consume_saved = (a.flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0;
  experts.stream = stream;

  std::lock_guard<std::mutex> lock(layer.context->execute_mutex);
  if (!whole_layer) {
    experts.ids = a.ids;
    experts.g = a.g;
    experts.dg = a.dg;
    experts.workspace = {a.workspace, a.workspace_bytes};
    backend.experts_backward(desc, experts);
    return;
  }

  Carver ws_carver(a.workspace);
  LayerBackwardScratch scratch = carve_layer_backward(ws_carver, backend, desc, T, a.flags);
  const bool need_router = a.dx != nullptr || a.dw_router != nullptr || a.d_logits != nullptr;

  experts.ids = experts.saved.ids;
  experts.g = experts.saved.g;
  experts.dg = need_router ? scratch.dg : nullptr;
  experts.workspace = scratch.sub;
  backend.experts_backward(desc, experts);
  if (!need_router) return;

  void* d_logits = a.d_logits ? a.d_logits : scratch.d_logits;
  RouterBackwardCall route;
  route.T = T;
  route.logits = experts.saved.logits;
  route.ids = experts.saved.ids;
  route.dg = scratch.dg;
  route.d_losses = a.d_losses;
  route.d_logits = d_logits;
  route.workspace = scratch.sub;
  route.stream = stream;
  backend.router_backward(desc, route);

  if (a.dx == nullptr && a.dw_router == nullptr) return;
  RouterProjectBackwardCall project;
  project.T = T;
  project.d_logits = d_logits;
  project.x = a.x;
  project.w_router = a.w_router;
  project.dx = a.dx;
  project.dw_router = a.dw_router;
  project.accumulate_wgrad = experts.accumulate_wgrad;
  project.workspace = scratch.sub;
  project.stream = stream;
  backend.router_project_backward(desc, project);
}

}  // namespace api
}  // namespace moeblaze
