"""The library's Hopper GEMM kernels by tag (F1, F2, B4, B1, B2, B3), from a kernel name as a
profiler prints it (torch.profiler, Nsight Compute, compute-sanitizer). Used by
tools/ncu_kernels.sh and dev/cuda/run_library_ab.sh, so the mapping lives in one place."""

# (tag, the name's key). bf16 instances only: the benchmark and the profiling scripts run bf16.
KERNEL_TAGS = (
    ("F1", "sm90_f1_kernel<__nv_bfloat16"),
    ("F2", "sm90_rows_kernel<__nv_bfloat16, 0"),
    ("B4", "sm90_rows_kernel<__nv_bfloat16, 1"),
    ("B1", "sm90_rows_kernel<__nv_bfloat16, 2"),
    ("B2", "sm90_wgrad_kernel<__nv_bfloat16, false"),
    ("B3", "sm90_wgrad_kernel<__nv_bfloat16, true"),
)
TAG_ORDER = tuple(tag for tag, _ in KERNEL_TAGS)


def kernel_tag(name):
    """The tag of a kernel name, or None for any other kernel."""
    n = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    n = n.replace("(bool)1", "true").replace("(bool)0", "false").replace("(int)", "")
    # Nsight Compute's raw page prints bool template arguments as 1 / 0.
    n = n.replace("sm90_wgrad_kernel<__nv_bfloat16, 1>", "sm90_wgrad_kernel<__nv_bfloat16, true>")
    n = n.replace("sm90_wgrad_kernel<__nv_bfloat16, 0>", "sm90_wgrad_kernel<__nv_bfloat16, false>")
    for tag, key in KERNEL_TAGS:
        if key in n:
            return tag
    return None
