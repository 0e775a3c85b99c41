"""moeblaze.hf.replace_moe_blocks on transformers models: tiny random Mixtral and Qwen3-MoE give the
original's logits, loss (with the load-balancing loss) and every gradient; weights are shared and
state dicts keep the original layout; layouts other families use (transposed, non-gated) match
transformers' own experts implementation; blocks moeblaze cannot run are named with the reason."""

import copy
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moeblaze as mb  # noqa: E402
from moeblaze import hf as mhf  # noqa: E402
from moeblaze import torch as mbt  # noqa: E402

try:
    from transformers.integrations.moe import batched_mm_experts_forward, use_experts_implementation
except ImportError:  # transformers 4.x: experts are per-expert modules, not swappable
    pytest.skip("needs transformers >= 5 (3-D experts modules)", allow_module_level=True)

HAVE_CUDA = torch.cuda.is_available() and mb.backend_available("cuda")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="CUDA variant: needs a GPU and a library "
                                                      "with the CUDA backend")

VOCAB = 101


def tiny_mixtral(**overrides):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
        max_position_embeddings=64, **overrides)
    return transformers.MixtralForCausalLM(config)


def tiny_qwen3_moe(**overrides):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=0.02, max_position_embeddings=64, decoder_sparse_step=1,
        mlp_only_layers=[1], **overrides)
    return transformers.Qwen3MoeForCausalLM(config)


MODELS = {"mixtral": (tiny_mixtral, 2), "qwen3_moe": (tiny_qwen3_moe, 2)}


def original_layout_grads(model):
    """Every parameter's gradient under the original model's names and layouts."""
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = None if p.grad is None else p.grad.detach()
    for name, module in model.named_modules():
        if isinstance(module, mhf.MoeblazeExperts):
            gate = grads.pop(f"{name}.w_gate")
            up = grads.pop(f"{name}.w_up")
            grads[f"{name}.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return grads


def train_step(model, ids, attention_mask=None):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, attention_mask=attention_mask)
    out.loss.backward()
    return out


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("with_padding", [False, True])
def test_swapped_model_matches_the_original(seed, family, with_padding):
    make, moe_layers = MODELS[family]
    torch.manual_seed(seed)
    original = make().float()
    swapped = copy.deepcopy(original)
    down_before = [m.experts.down_proj for m in swapped.modules() if hasattr(m, "experts")]
    assert mhf.replace_moe_blocks(swapped) == moe_layers
    assert not list(mhf.experts_modules(swapped))
    # down_proj is shared: the very same Parameter objects
    down_after = [m.experts.down_proj for m in swapped.modules() if hasattr(m, "experts")]
    assert all(a is b for a, b in zip(down_before, down_after))

    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (3, 13), generator=gen)
    mask = None
    if with_padding:
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
    ref = train_step(original, ids, mask)
    out = train_step(swapped, ids, mask)
    assert len(out.router_logits) == moe_layers
    # the router is the original's: the first layer's logits are the same bits, later layers'
    # inherit the rounding differences of the layers before them
    torch.testing.assert_close(out.router_logits[0], ref.router_logits[0], rtol=0, atol=0)
    for mine, theirs in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    mine, theirs = original_layout_grads(swapped), original_layout_grads(original)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        if theirs[name] is None:
            assert mine[name] is None, name
            continue
        assert torch.isfinite(mine[name]).all(), name
        scale = max(1.0, float(theirs[name].abs().max()))
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(MODELS))
def test_state_dict_keeps_the_original_layout(seed, family):
    make, _ = MODELS[family]
    torch.manual_seed(seed)
    original = make().float()
    swapped = copy.deepcopy(original)
    mhf.replace_moe_blocks(swapped)
    theirs, mine = original.state_dict(), swapped.state_dict()
    assert list(mine.keys()) == list(theirs.keys())
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key
    # an original checkpoint loads into the swapped model and the other way round
    torch.manual_seed(seed + 7)
    other = make().float()
    swapped.load_state_dict(other.state_dict())
    original.load_state_dict(swapped.state_dict())
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = other(input_ids=ids).logits
        torch.testing.assert_close(swapped(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(original(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_save_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    swapped = tiny_mixtral().float()
    mhf.replace_moe_blocks(swapped)
    swapped.save_pretrained(tmp_path)
    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, swapped(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_training_updates_the_shared_weights():
    torch.manual_seed(0)
    model = tiny_qwen3_moe().float()
    mhf.replace_moe_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(10):
        out = train_step(model, ids)
        optimizer.step()
        losses.append(float(out.loss))
    assert losses[-1] < 0.7 * losses[0], losses


def test_compiled_block_has_no_graph_breaks():
    torch.manual_seed(0)
    model = tiny_mixtral().float()
    mhf.replace_moe_blocks(model)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 7, 32, requires_grad=True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = block(x)
    eager.square().sum().backward()
    dx = x.grad.clone()
    x.grad = None
    compiled = torch.compile(block, fullgraph=True)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, dx, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not os.environ.get("MOEBLAZE_TEST_SLOW"),
                    reason="slow (compiles a whole transformers model, minutes on 2 cores): set "
                           "MOEBLAZE_TEST_SLOW=1")
def test_compiled_whole_model_fullgraph():
    torch.manual_seed(0)
    model = tiny_mixtral().float()
    mhf.replace_moe_blocks(model)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    eager = train_step(model, ids)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    compiled = train_step(torch.compile(model, fullgraph=True), ids)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Other layouts of transformers' experts convention, against its own experts implementation
# ------------------------------------------------------------------------------------------------


class _Config:
    _experts_implementation = "eager"


def _experts_class(is_transposed, has_gate, act):
    @use_experts_implementation(is_transposed=is_transposed, has_gate=has_gate)
    class Experts(torch.nn.Module):
        def __init__(self, config, E=5, d=12, h=10):
            super().__init__()
            self.num_experts = E
            fused = 2 * h if has_gate else h
            up_shape = (E, d, fused) if is_transposed else (E, fused, d)
            down_shape = (E, h, d) if is_transposed else (E, d, h)
            up = torch.nn.Parameter(torch.randn(*up_shape) * 0.3)
            if has_gate:
                self.gate_up_proj = up
            else:
                self.up_proj = up
            self.down_proj = torch.nn.Parameter(torch.randn(*down_shape) * 0.3)
            self.act_fn = transformers.activations.ACT2FN[act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return Experts


@pytest.mark.parametrize("is_transposed,has_gate,act,expected", [
    (False, True, "silu", "swiglu"), (True, True, "silu", "swiglu"),
    (False, True, "gelu", "geglu"), (False, False, "relu2", "relu2"),
    (True, False, "silu", "silu")])
def test_layouts_match_transformers_experts_implementation(seed, is_transposed, has_gate, act,
                                                          expected):
    torch.manual_seed(seed)
    original = _experts_class(is_transposed, has_gate, act)(_Config())
    assert mhf.swap_blocker(original) is None
    swapped = mhf.MoeblazeExperts.from_transformers(copy.deepcopy(original))
    assert swapped.activation == expected
    T, k = 9, 2
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 12, generator=gen, requires_grad=True)
    ids = torch.stack([torch.randperm(5, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, requires_grad=True)
    y_ref = original(x, ids, w)
    y_ref.square().sum().backward()
    ref_grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    y = swapped(x, ids, w)
    y.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_grads[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_grads[1], rtol=1e-4, atol=1e-5)
    # weight gradients in the original layout through the state-dict transform
    state = swapped.state_dict()
    assert state.keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(state[key], value), key


# ------------------------------------------------------------------------------------------------
# Blocks that cannot run on moeblaze
# ------------------------------------------------------------------------------------------------


def tiny_gpt_oss():
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.GptOssForCausalLM(config)


def test_gpt_oss_is_refused_with_the_reasons():
    model = tiny_gpt_oss()
    found = list(mhf.experts_modules(model))
    assert len(found) == 2
    reason = mhf.swap_blocker(found[0][1])
    assert "expert biases" in reason and "_apply_gate" in reason
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts \(GptOssExperts\) "
                                         r"cannot run on moeblaze: expert biases"):
        mhf.replace_moe_blocks(model)
    assert mhf.replace_moe_blocks(model, strict=False) == 0
    assert len(list(mhf.experts_modules(model))) == 2  # left as they were


def test_unknown_activation_is_refused():
    experts = _experts_class(False, True, "gelu_pytorch_tanh")(_Config())
    assert "activation moeblaze does not have" in mhf.swap_blocker(experts)


class _Clamped(torch.nn.Module):
    """SiLU clamped far beyond the usual activation range (equal to SiLU below 500)."""

    def forward(self, x):
        return torch.nn.functional.silu(x).clamp(max=500.0)


@pytest.mark.parametrize("has_gate", [True, False])
@pytest.mark.parametrize("act", ["relu6", "gelu_10", "gelu_new", "leaky_relu", _Clamped])
def test_clamped_or_approximate_activations_are_refused(has_gate, act):
    """ReLU6 equals ReLU and ClippedGELU(-10, 10) equals GELU on [-6, 6]: they must not be taken
    for them (the swapped model would compute other values for larger pre-activations)."""
    experts = _experts_class(False, has_gate, act if isinstance(act, str) else "silu")(_Config())
    if not isinstance(act, str):
        experts.act_fn = act()
    assert "activation moeblaze does not have" in mhf.swap_blocker(experts)
    with pytest.raises(ValueError, match="activation moeblaze does not have"):
        mhf.MoeblazeExperts.from_transformers(experts)


def test_activations_are_recognised_by_value_and_name():
    act_of = mhf._activation_of
    assert act_of(torch.nn.SiLU(), True) == "swiglu"
    assert act_of(torch.nn.functional.silu, False) == "silu"
    assert act_of(lambda t: t * torch.sigmoid(t), True) == "swiglu"  # equal values, any name
    assert act_of(torch.nn.GELU(), True) == "geglu"
    assert act_of(torch.nn.GELU(approximate="tanh"), True) is None
    assert act_of(torch.nn.ReLU(), False) == "relu"
    assert act_of(torch.nn.ReLU6(), False) is None
    assert act_of(torch.nn.Hardtanh(0.0, 1e6), False) is None  # ReLU up to 1e6
    assert act_of(lambda t: 1e6 * torch.tanh(torch.nn.functional.silu(t) / 1e6), True) is None

    class SiLU(torch.nn.Module):  # a known name must compute what the name says
        def forward(self, x):
            return torch.relu(x)
    assert act_of(SiLU(), False) is None


def test_whole_model_with_relu6_keeps_the_original():
    torch.manual_seed(0)
    model = tiny_mixtral(hidden_act="relu6").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.mul_(40.0)  # pre-activations well beyond 6
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(ValueError, match="ReLU6"):
        mhf.replace_moe_blocks(model)
    assert mhf.replace_moe_blocks(model, strict=False) == 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_int64_expert_ids_are_not_wrapped(seed):
    """ids + 2^32 would narrow to the valid ids: they are refused as out of range instead."""
    torch.manual_seed(seed)
    experts = mhf.MoeblazeExperts.from_transformers(_experts_class(False, True, "silu")(_Config()))
    T, k = 7, 2
    x = torch.randn(T, 12)
    ids = torch.stack([torch.randperm(5)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    y = experts(x, ids, w)
    torch.testing.assert_close(experts(x, ids.to(torch.int32), w), y, rtol=0, atol=0)
    for wrap in (1 << 32, -(1 << 32), 1 << 40):
        bad = ids.clone()
        bad[3, 1] += wrap
        with pytest.raises(mb.InvalidArgumentError, match="out of range"):
            experts(x, bad, w)
    with pytest.raises(TypeError, match="top_k_index"):
        experts(x, ids.double(), w)


# ------------------------------------------------------------------------------------------------
# GPU: bf16
# ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("family", sorted(MODELS))
def test_swapped_model_matches_the_original_bf16_cuda(seed, family):
    make, _ = MODELS[family]
    torch.manual_seed(seed)
    original = make().to(device="cuda", dtype=torch.bfloat16)
    swapped = copy.deepcopy(original)
    mhf.replace_moe_blocks(swapped)
    ids = torch.randint(0, VOCAB, (4, 32), device="cuda")
    ref = train_step(original, ids)
    out = train_step(swapped, ids)
    # bf16: a token whose top-k is a near tie may pick another expert in a later layer, so the
    # comparison is of whole tensors (relative error of the norm), not of each element
    logits, ref_logits = out.logits.float(), ref.logits.float()
    assert torch.isfinite(logits).all()
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < 2e-2
    torch.testing.assert_close(out.loss.float(), ref.loss.float(), rtol=1e-2, atol=1e-2)
    mine, theirs = original_layout_grads(swapped), original_layout_grads(original)
    for name in theirs:
        if theirs[name] is None:
            continue
        a, b = mine[name].float(), theirs[name].float()
        assert torch.isfinite(a).all(), name
        # bf16: compare directions (the two sum in different orders and precisions)
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))
    assert mbt.CUSTOM_OPS
