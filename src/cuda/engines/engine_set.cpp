#include "cuda/engines/engine_set.hpp"

namespace moeblaze {
namespace cuda {

int64_t EngineSet::max_b1_dg_parts(int64_t h) {
  const int64_t sm90 = Sm90Engine(Sm90Forms{}).b1_dg_parts(h);
  const int64_t portable = PortableEngine::max_b1_dg_parts(h);
  return sm90 > portable ? sm90 : portable;
}

size_t EngineSet::tile_scratch_ints(int64_t N, int64_t E) {
  return PortableEngine::tile_scratch_ints(N, E);
}

void EngineSet::prepare_device(int device) {
  PortableEngine::prepare_device();
  sm90_prepare_device(device);
}

}  // namespace cuda
}  // namespace moeblaze
