"""moeblaze.ep (expert parallelism, numpy, LOCAL transport on the CPU backend) against the
one-device numpy layer (moeblaze.Layer) on the global batch: the ranks' tokens in rank order and
every rank's experts in rank order.

What must be bitwise equal follows docs/design/expert-parallel.md section 5 and the C test
tests/ep/test_ep_cpu.cpp: logits, ids, g, the global expert counts, y (F32 and F64), dg, d_logits
and dw_gate/dw_up/dw_down; at world size 1 also dw_router and the losses. Equal up to summation
grouping (tolerance relative to the largest magnitude): dx, the sum of the dw_router shares and the
sum of the loss shares.
"""

import ctypes

import numpy as np
import pytest

import moeblaze as mb
from moeblaze import _lib, ep

AUX, Z = float(np.float32(0.01)), float(np.float32(0.001))
D_LOSSES = (0.7, 1.3)
RELATIVE_TOLERANCE = {"float32": 2e-6, "float64": 1e-14}


def relative_error(mine, reference):
    mine, reference = np.asarray(mine, np.float64), np.asarray(reference, np.float64)
    assert np.all(np.isfinite(mine)), "non-finite values"  # NaN never passes
    scale = max(float(np.max(np.abs(reference), initial=0.0)), 1e-300)
    return float(np.max(np.abs(mine - reference), initial=0.0)) / scale


def assert_bitwise(mine, reference, name):
    assert mine.dtype == reference.dtype, name
    assert mine.shape == reference.shape, name
    assert np.array_equal(mine.view(np.uint8), reference.view(np.uint8)), \
        f"{name}: not bitwise equal (max abs diff " \
        f"{np.max(np.abs(mine.astype(np.float64) - reference), initial=0.0)})"


def make_problem(seed, tokens, d, h, E, dtype):
    rng = np.random.default_rng(seed)
    T = sum(tokens)
    draw = lambda *shape, s=1.0: (s * rng.standard_normal(shape)).astype(dtype)  # noqa: E731
    return dict(x=draw(T, d), w_router=draw(E, d), w_gate=draw(E, h, d, s=0.5),
                w_up=draw(E, h, d, s=0.5), w_down=draw(E, d, h, s=0.5), dy=draw(T, d))


def run_ep(world_size, tokens, config, problem, *, repeat_backward=True):
    """Every rank's forward and backward on its own thread; returns per-rank dicts."""
    offsets = np.concatenate([[0], np.cumsum(tokens)])
    routing_dtype = np.float64 if config["dtype"] == "float64" else np.float32
    d_losses = np.array(D_LOSSES, routing_dtype)

    with ep.LocalGroup(world_size) as group:
        def rank_main(rank):
            rows = slice(offsets[rank], offsets[rank + 1])
            with mb.Context(num_threads=1) as context:
                layer = ep.EpLayer(context, rank=rank, world_size=world_size, group=group,
                                   **config)
                local = layer.local_experts
                p = problem
                out = layer.forward(p["x"][rows], p["w_router"], p["w_gate"][local],
                                    p["w_up"][local], p["w_down"][local],
                                    need=("logits", "ids", "g", "expert_counts", "losses"))
                need = ("dx", "dw_router", "dw_gate", "dw_up", "dw_down", "dg", "d_logits")
                grads = layer.backward(p["dy"][rows], d_losses=d_losses, need=need)
                again = layer.backward(p["dy"][rows], d_losses=d_losses, need=need) \
                    if repeat_backward else None
                layer.close()
                return dict(experts=layer.experts, out=out, grads=grads, again=again)

        return ep.run_local(world_size, rank_main)


def one_device(config, problem):
    layer = mb.Layer(**config)
    p = problem
    out = layer.forward(p["x"], p["w_router"], p["w_gate"], p["w_up"], p["w_down"])
    d_losses = np.array(D_LOSSES, layer.routing_dtype)
    grads = layer.backward(out, p["dy"], p["x"], p["w_router"], p["w_gate"], p["w_up"],
                           p["w_down"], d_losses=d_losses,
                           need=("dx", "dw_router", "dw_gate", "dw_up", "dw_down", "d_logits"))
    # dg is not an output of the whole-layer backward: the experts backward with the router's
    # ids and g gives it.
    experts = layer.experts_forward(p["x"], out.ids, out.g, p["w_gate"], p["w_up"], p["w_down"])
    dg = layer.experts_backward(experts, p["dy"], p["x"], out.ids, out.g, p["w_gate"], p["w_up"],
                                p["w_down"], need=("dg",)).dg
    return out, grads, dg


CASES = [  # (world_size, tokens per rank, num_experts, activation, top_k)
    (1, [7], 5, "swiglu", 2),
    (2, [3, 8], 5, "swiglu", 2),   # uneven tokens and experts (3 + 2)
    (2, [0, 6], 4, "geglu", 2),    # rank 0 has no tokens
    (3, [7, 0, 4], 5, "silu", 3),  # non-gated, a rank without tokens, experts 2 + 2 + 1
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("world_size,tokens,E,act,k", CASES)
def test_ep_matches_one_device_layer(seed, dtype, world_size, tokens, E, act, k):
    d, h = 8, 6
    config = dict(d_model=d, d_ffn=h, num_experts=E, top_k=k, activation=act, dtype=dtype,
                  aux_loss_coeff=AUX, z_loss_coeff=Z)
    problem = make_problem(seed, tokens, d, h, E, dtype)
    ranks = run_ep(world_size, tokens, config, problem)
    ref_out, ref_grads, ref_dg = one_device(config, problem)
    tolerance = RELATIVE_TOLERANCE[dtype]

    # Placement: contiguous, E // W each, one more on the first E % W ranks.
    begins = [r["experts"][0] for r in ranks]
    ends = [r["experts"][1] for r in ranks]
    assert begins[0] == 0 and ends[-1] == E and begins[1:] == ends[:-1]
    assert [e - b for b, e in zip(begins, ends)] == \
        [E // world_size + (1 if r < E % world_size else 0) for r in range(world_size)]

    cat = lambda get: np.concatenate([get(r) for r in ranks])  # noqa: E731
    for name in ("y", "logits", "ids", "g"):
        assert_bitwise(cat(lambda r: getattr(r["out"], name)), getattr(ref_out, name), name)
    for r in ranks:
        assert_bitwise(r["out"].expert_counts, ref_out.expert_counts, "expert_counts (global)")
    # Rows received by a rank's experts = the routed pairs of its experts over the global batch.
    for r in ranks:
        b, e = r["experts"]
        assert r["out"].recv_rows == int(ref_out.expert_counts[b:e].sum())
    assert_bitwise(cat(lambda r: r["grads"].dg), ref_dg, "dg")
    assert_bitwise(cat(lambda r: r["grads"].d_logits), ref_grads.d_logits, "d_logits")
    for name in ("dw_gate", "dw_up", "dw_down"):
        if not act.endswith("glu") and name == "dw_up":
            assert all(r["grads"].dw_up is None for r in ranks)
            continue
        assert_bitwise(cat(lambda r: getattr(r["grads"], name)), getattr(ref_grads, name), name)

    dx = cat(lambda r: r["grads"].dx)
    assert relative_error(dx, ref_grads.dx) <= tolerance, "dx"
    dw_router = ranks[0]["grads"].dw_router.copy()
    losses = ranks[0]["out"].losses.copy()
    for r in ranks[1:]:  # replicated parameter: sum the shares in rank order
        dw_router += r["grads"].dw_router
        losses += r["out"].losses
    if world_size == 1:
        assert_bitwise(dw_router, ref_grads.dw_router, "dw_router")
        assert_bitwise(losses, ref_out.losses, "losses")
    else:
        assert relative_error(dw_router, ref_grads.dw_router) <= tolerance, "dw_router"
        assert relative_error(losses, ref_out.losses) <= tolerance, "losses"
        assert losses[0] > 0 and losses[1] > 0  # both losses are on: the check is not vacuous

    # A step may be back-propagated again: bitwise the same.
    for r in ranks:
        for name in ("dx", "dw_router", "dw_gate", "dw_up", "dw_down", "dg", "d_logits"):
            first, second = getattr(r["grads"], name), getattr(r["again"], name)
            if first is None:
                assert second is None
            else:
                assert_bitwise(second, first, f"repeated backward {name}")


def test_accumulate_and_step_argument(seed):
    """grads_out + accumulate add into the arrays; an explicit step (the forward result) works."""
    d, h, E, k, tokens = 4, 3, 4, 2, [5, 2]
    config = dict(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float64")
    p = make_problem(seed, tokens, d, h, E, np.float64)

    with ep.LocalGroup(2) as group:
        def rank_main(rank):
            rows = slice(0, 5) if rank == 0 else slice(5, 7)
            layer = ep.EpLayer(rank=rank, group=group, **config)
            local = layer.local_experts
            out = layer.forward(p["x"][rows], p["w_router"], p["w_gate"][local],
                                p["w_up"][local], p["w_down"][local], need=())
            assert out.losses is None and out.ids is None and out.step is not None
            plain = layer.backward(p["dy"][rows], step=out)
            E_r = layer.num_local_experts
            sums = ep.EpGradients(dw_gate=mb.aligned_empty((E_r, h, d), np.float64),
                                  dw_up=mb.aligned_empty((E_r, h, d), np.float64),
                                  dw_down=mb.aligned_empty((E_r, d, h), np.float64))
            for array in (sums.dw_gate, sums.dw_up, sums.dw_down):
                array.fill(0.0)
            for _ in range(2):
                layer.backward(p["dy"][rows], step=out.step, grads_out=sums, accumulate=True)
            return plain, sums

        results = ep.run_local(2, rank_main)
    for plain, sums in results:
        for name in ("dw_gate", "dw_up", "dw_down"):
            # 0 + g + g = 2g exactly in binary floating point.
            assert_bitwise(getattr(sums, name), 2 * getattr(plain, name), name)
        assert sums.dx is None


def test_inference_keeps_no_step(seed):
    p = make_problem(seed, [4], 4, 3, 2, np.float32)
    with ep.LocalGroup(1) as group:
        layer = ep.EpLayer(rank=0, group=group, d_model=4, d_ffn=3, num_experts=2, top_k=1)
        out = layer.forward(p["x"], p["w_router"], p["w_gate"], p["w_up"], p["w_down"],
                            training=False)
        assert out.step is None and out.y.shape == (4, 4)
        with pytest.raises(mb.InvalidArgumentError, match="forward_begin"):
            layer.backward(p["dy"])


# ------------------------------------------------------------------------------------------------
# Errors: raised with the library's own message
# ------------------------------------------------------------------------------------------------

SMALL = dict(d_model=4, d_ffn=3, num_experts=4, top_k=2, dtype="float32")


def assert_library_message(error, status, *words):
    assert isinstance(error, mb.MoeblazeError)
    assert error.status == status
    assert error.message and str(error) == error.message  # the library's text, verbatim
    for word in words:
        assert word in error.message, (word, error.message)


@pytest.mark.parametrize("rank", [2, -1])
def test_wrong_rank(rank):
    with ep.LocalGroup(2) as group:
        with pytest.raises(ValueError) as info:
            ep.EpLayer(rank=rank, group=group, **SMALL)
    assert_library_message(info.value, _lib.ERR_INVALID_ARGUMENT, "rank")


def test_workspace_size_flags():
    with ep.LocalGroup(1) as group:
        layer = ep.EpLayer(rank=0, group=group, **SMALL)
        plain = layer.workspace_size(_lib.EP_PASS_BACKWARD, 6, 12)
        assert plain > 0
        # The CPU backend ignores CONSUME_SAVED: the same size; the forward passes ignore flags.
        assert layer.workspace_size(_lib.EP_PASS_BACKWARD, 6, 12,
                                    flags=_lib.BACKWARD_CONSUME_SAVED) == plain
        assert layer.workspace_size(_lib.EP_PASS_FORWARD_FINISH, 6, 12,
                                    flags=_lib.BACKWARD_CONSUME_SAVED) == \
            layer.workspace_size(_lib.EP_PASS_FORWARD_FINISH, 6, 12)
        with pytest.raises(ValueError) as info:
            layer.workspace_size(_lib.EP_PASS_BACKWARD, 6, 12, flags=4)
        assert_library_message(info.value, _lib.ERR_INVALID_ARGUMENT, "flags", "unknown bits")
        layer.close()


def test_world_size_larger_than_num_experts():
    with ep.LocalGroup(5) as group:
        with pytest.raises(ValueError) as info:
            ep.EpLayer(rank=0, group=group, **SMALL)  # 5 ranks, 4 experts
    assert_library_message(info.value, _lib.ERR_INVALID_ARGUMENT, "world_size")


def test_group_of_another_size():
    with ep.LocalGroup(3) as group:
        with pytest.raises(ValueError) as info:
            ep.EpLayer(rank=0, world_size=2, group=group, **SMALL)
    assert_library_message(info.value, _lib.ERR_INVALID_ARGUMENT)


def test_bad_world_size_of_group():
    with pytest.raises(ValueError) as info:
        ep.LocalGroup(0)
    assert_library_message(info.value, _lib.ERR_INVALID_ARGUMENT, "world_size")


def test_backward_before_forward_on_every_rank():
    with ep.LocalGroup(2) as group:
        def rank_main(rank):
            layer = ep.EpLayer(rank=rank, group=group, **SMALL)
            layer.backward(np.zeros((3, 4), np.float32))

        with pytest.raises(ValueError) as info:
            ep.run_local(2, rank_main, timeout=30)
    assert_library_message(info.value, _lib.ERR_INVALID_ARGUMENT, "moeblaze_ep_forward_begin",
                           "moeblaze_ep_backward")


def test_nccl_transport_on_a_cpu_context_is_not_supported():
    with ep.LocalGroup(1) as group:
        # Any non-NULL address: the library refuses NCCL on a CPU context before using it.
        address = ctypes.cast(group.handle, ctypes.c_void_p).value
        with pytest.raises(NotImplementedError) as info:
            ep.EpLayer(rank=0, world_size=1, transport="nccl", communicator=address, **SMALL)
    assert_library_message(info.value, _lib.ERR_NOT_SUPPORTED, "NCCL")


def test_python_side_argument_errors():
    with ep.LocalGroup(2) as group:
        with pytest.raises(TypeError, match="LocalGroup"):
            ep.EpLayer(rank=0, world_size=2, **SMALL)
        with pytest.raises(TypeError, match="int address"):
            ep.EpLayer(rank=0, world_size=2, transport="nccl", communicator="comm", **SMALL)
        with pytest.raises(ValueError, match="transport"):
            ep.EpLayer(rank=0, group=group, transport="mpi", **SMALL)
        layer = ep.EpLayer(rank=0, group=group, **SMALL)
        assert layer.experts == (0, 2) and layer.num_local_experts == 2
        # Global weights instead of this rank's: refused before any collective call.
        x = np.zeros((3, 4), np.float32)
        with pytest.raises(ValueError, match=r"w_gate: expected shape \[2, 3, 4\]"):
            layer.forward(x, np.zeros((4, 4), np.float32), np.zeros((4, 3, 4), np.float32),
                          np.zeros((4, 3, 4), np.float32), np.zeros((4, 4, 3), np.float32))
        with pytest.raises(ValueError, match="need"):
            layer.forward(x, None, None, None, None, need=("y2",))
        # a bare string would be a set of letters: nothing valid, so every output skipped
        with pytest.raises(ValueError, match=r"need: .*string 'ids'"):
            layer.forward(x, None, None, None, None, need="ids")
        with pytest.raises(ValueError, match=r"need: .*string 'dx'"):
            layer.backward(x, need="dx")


def test_device_arrays_are_out_of_scope():
    with ep.LocalGroup(1) as group:
        layer = ep.EpLayer(rank=0, group=group, **SMALL)

        class FakeCudaContext:  # what a CUDA context looks like to the numpy checks
            backend = _lib.BACKEND_CUDA

        layer.context = FakeCudaContext()
        with pytest.raises(ValueError, match="device arrays are out of scope"):
            layer.forward(np.zeros((1, 4), np.float32), None, None, None, None)
        with pytest.raises(ValueError, match="device arrays are out of scope"):
            layer.backward(np.zeros((1, 4), np.float32))


def test_run_local_reraises_the_first_error_and_returns_in_rank_order():
    assert ep.run_local(3, lambda rank: rank * 10) == [0, 10, 20]

    def fail_on_rank_one(rank):
        if rank == 1:
            raise KeyError("rank one")
        return rank

    with pytest.raises(KeyError, match="rank one"):
        ep.run_local(3, fail_on_rank_one)


def test_closed_handles_and_export():
    assert mb.ep is ep
    group = ep.LocalGroup(1)
    layer = ep.EpLayer(rank=0, group=group, **SMALL)
    group.close()  # the layer keeps the C group alive
    out = layer.forward(np.ones((2, 4), np.float32), np.ones((4, 4), np.float32),
                        np.ones((4, 3, 4), np.float32), np.ones((4, 3, 4), np.float32),
                        np.ones((4, 4, 3), np.float32))
    assert np.all(np.isfinite(out.y))
    layer.close()
    with pytest.raises(ValueError, match="closed"):
        layer.workspace_size(_lib.EP_PASS_FORWARD_BEGIN, 1)
    with pytest.raises(ValueError, match="closed"):
        ep.EpLayer(rank=0, group=group, **SMALL)
