// What a moeblaze_layer_t names: an immutable, validated layer plan and the context it runs on.
#pragma once

#include <memory>

#include "common/context.hpp"
#include "common/layer_desc.hpp"

namespace moeblaze {
namespace api {

struct LayerState {
  std::shared_ptr<ContextState> context;
  LayerDesc desc;
  moeblaze_layer_config_t config;  // the validated config, struct_size = sizeof in this build
};

}  // namespace api
}  // namespace moeblaze
