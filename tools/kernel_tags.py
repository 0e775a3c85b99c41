"""The library's Hopper GEMM kernels by tag (F1, F2, B4, B1, B2, B3), its per-token reductions
(RD) and its router's forward and backward kernels (RF, RB), from a kernel name as a profiler
prints it (torch.profiler, Nsight Compute, compute-sanitizer). Used by tools/ncu_kernels.sh and
tests/cuda/profile_kernels.py, so the mapping lives in one place."""

# (tag, the name's key). bf16 instances only: the benchmark and the profiling scripts run bf16.
KERNEL_TAGS = (
    ("F1", "sm90_f1_kernel<__nv_bfloat16"),
    ("F2", "sm90_rows_kernel<__nv_bfloat16, 0"),
    ("B4", "sm90_rows_kernel<__nv_bfloat16, 1"),
    ("B1", "sm90_rows_kernel<__nv_bfloat16, 2"),
    ("B2", "sm90_wgrad_kernel<__nv_bfloat16, false"),
    ("B3", "sm90_wgrad_kernel<__nv_bfloat16, true"),
    # the opt-in ping-pong forms of F2 and B4 (MOEBLAZE_CUDA_ROWS_FORM=pingpong, pingpong128,
    # pingpong2cta)
    ("F2", "sm90_rows_pingpong_kernel<__nv_bfloat16, 0"),
    ("B4", "sm90_rows_pingpong_kernel<__nv_bfloat16, 1"),
    # the per-token sums of F2's and B4's rows into y and dx (every dtype, every engine)
    ("RD", "token_reduce"),
    # the router: scores, top-k and weights (forward); the logits' gradient (backward)
    ("RF", "router_forward_kernel"),
    ("RB", "router_backward_kernel"),
)
TAG_ORDER = tuple(dict.fromkeys(tag for tag, _ in KERNEL_TAGS))
GEMM_TAGS = frozenset(TAG_ORDER) - {"RD", "RF", "RB"}


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


# What a kernel of a profiled step does, by its name, for the split of a step's GPU time between
# matrix work and the rest (tests/cuda/profile_kernels.py, whichever implementation it profiles).
# First match wins: the library's GEMMs (by tag, or by kernel name for the F16 instances, which
# have no tag), then cuBLAS / CUTLASS GEMMs (torch._grouped_mm, torch.matmul), then the
# permutation work of the PyTorch dataflows, then elementwise kernels.
KERNEL_CLASSES = (
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "cublas", "sm90_f1_kernel",
              "sm90_rows_kernel", "sm90_rows_pingpong_kernel", "sm90_wgrad_kernel")),
    ("sort/index/scatter", ("sort", "radix", "scan", "cumsum", "index", "gather", "scatter",
                            "histogram", "bincount")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill")),
)


def kernel_class(name):
    """'gemm', 'sort/index/scatter', 'elementwise' or 'other' for a kernel name."""
    if kernel_tag(name) in GEMM_TAGS:
        return "gemm"
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(key in low for key in keys):
            return cls
    return "other"


def split_by_class(kernels):
    """(name, microseconds) pairs -> {class: microseconds}, every class present (0.0 if none)."""
    out = {cls: 0.0 for cls, _ in KERNEL_CLASSES}
    out["other"] = 0.0
    for name, us in kernels:
        out[kernel_class(name)] += us
    return out


def kernels_over_steps(steps):
    """Per kernel name over several profiled steps, each a list of (name, microseconds): rows
    (name, calls a step, median, min, max microseconds a step), the largest median first. One
    step's times vary by several per cent between steps, so a comparison of two kernel forms needs
    the median of a few. A kernel missing from a step counts 0 there."""
    names = list(dict.fromkeys(name for step in steps for name, _ in step))
    rows = []
    for name in names:
        per_step, calls = [], 0
        for step in steps:
            times = [us for n, us in step if n == name]
            per_step.append(sum(times))
            calls = max(calls, len(times))
        ordered = sorted(per_step)
        middle = len(ordered) // 2
        median = ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] +
                                                                   ordered[middle])
        rows.append((name, calls, median, ordered[0], ordered[-1]))
    return sorted(rows, key=lambda row: -row[2])


def self_test():
    names = {
        "void moeblaze::cuda::(anonymous namespace)::sm90_f1_kernel<__nv_bfloat16, 0, true>(x)": "F1",
        "void moeblaze::cuda::(anonymous namespace)::sm90_wgrad_kernel<__nv_bfloat16, (bool)1>(x)":
            "B3",
        "sm90_wgrad_kernel<__nv_bfloat16, 0>(CUtensorMap_st, Params)": "B2",
        "sm90_rows_kernel<__nv_bfloat16, 2, 0, 2>(Params)": "B1",
        "void moeblaze::cuda::(anonymous namespace)::sm90_rows_pingpong_kernel<__nv_bfloat16, 0, "
        "192>(CUtensorMap_st)": "F2",
        "sm90_rows_pingpong_kernel<__nv_bfloat16, (int)1, (int)128>(CUtensorMap_st)": "B4",
        "void at::native::vectorized_elementwise_kernel<4, ...>": None,
        "void moeblaze::cuda::(anonymous namespace)::token_reduce16_kernel<__nv_bfloat16>(long)":
            "RD",
        "void moeblaze::cuda::(anonymous namespace)::router_forward_kernel<4>(RouterParams)": "RF",
    }
    for name, tag in names.items():
        assert kernel_tag(name) == tag, (name, kernel_tag(name), tag)
    classes = {
        "sm90_rows_kernel<__nv_bfloat16, 0, 0, 0>(Params)": "gemm",
        "sm90_wgrad_kernel<__half, true>(CUtensorMap_st, Params)": "gemm",  # no tag: F16
        "sm90_rows_pingpong_kernel<__half, 1, 192>(CUtensorMap_st)": "gemm",
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::"
        "kernel::GemmUniversal<...>>>": "gemm",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "gemm",
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>": "sort/index/scatter",
        "void at::native::index_elementwise_kernel<128, 4, ...>": "sort/index/scatter",
        "void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>": "sort/index/scatter",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel...>":
            "elementwise",
        "void at::native::reduce_kernel<512, 1, ...>": "other",
        "void moeblaze::cuda::(anonymous namespace)::token_reduce16_kernel<__half>(long)": "other",
    }
    for name, cls in classes.items():
        assert kernel_class(name) == cls, (name, kernel_class(name), cls)
    split = split_by_class([("nvjet_x", 3.0), ("sm90_f1_kernel<__nv_bfloat16, 0, true>", 2.0),
                            ("radix_sort", 1.5), ("reduce_kernel", 0.25)])
    assert split == {"gemm": 5.0, "sort/index/scatter": 1.5, "elementwise": 0.0, "other": 0.25}, split
    assert TAG_ORDER == ("F1", "F2", "B4", "B1", "B2", "B3", "RD", "RF", "RB"), TAG_ORDER
    assert kernel_class("router_forward_kernel<4>(RouterParams)") == "other"
    rows = kernels_over_steps([[("a", 1.0), ("b", 5.0), ("a", 2.0)], [("a", 4.0)],
                               [("a", 3.5), ("b", 1.0)]])
    assert rows == [("a", 2, 3.5, 3.0, 4.0), ("b", 1, 1.0, 0.0, 5.0)], rows
    rows = kernels_over_steps([[("a", 1.0)], [("a", 3.0)]])
    assert rows == [("a", 1, 2.0, 1.0, 3.0)], rows
    print("kernel_tags self-test: ok")
    return 0


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--self-test"]:
        sys.exit("usage: tools/kernel_tags.py --self-test (a module: see its docstring)")
    sys.exit(self_test())
