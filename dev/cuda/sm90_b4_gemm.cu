// Kernel workshop, round 3: B4 on Hopper (sm_90a). The kernel, the fp32 device oracle, the CPU
// fp64 spot check and the timing harness are in sm90_rows_gemm.cuh (shared by F2, B4 and B1); its
// header comment is the design. Build from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v \
//        -o /tmp/sm90_b4_gemm dev/cuda/sm90_b4_gemm.cu -lcublas
// Run: /tmp/sm90_b4_gemm [--check-only] [--shape edge|conf3|conf4|mixtral|qwen] [--seed N]
#include "sm90_rows_gemm.cuh"

int main(int argc, char** argv) { return run_main<Kind::B4>(argc, argv); }
