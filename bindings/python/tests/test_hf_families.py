"""moeblaze.hf.replace_moe_blocks on every transformers family whose experts use
`use_experts_implementation` (found by scanning transformers.models): a tiny random model of each,
run forward and backward unswapped and swapped (fp32, CPU, eval mode), gives the original's logits,
loss, router logits and every gradient when swapped, and stays bit for bit the original when each
of its experts modules is refused with a reason. The README's table of families is checked against
a few anchors. About 30 s on one core (every family builds and runs a model)."""

import copy
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moeblaze import hf as mhf  # noqa: E402

try:
    from transformers.integrations.moe import use_experts_implementation  # noqa: F401
except ImportError:  # transformers 4.x: experts are per-expert modules, not swappable
    pytest.skip("needs transformers >= 5 (3-D experts modules)", allow_module_level=True)

README = Path(__file__).resolve().parent.parent / "README.md"
VOCAB = 101
# max|diff| / max|ref|: a swapped family's experts round in another order (~1e-7 relative), which
# recurrent layers downstream amplify (qwen3_next's linear-attention dt_bias gradient reached
# 5e-5 at one seed); a wrong model is off by percents (ReLU6 taken for ReLU: 10 % in the logits).
LOGITS_RTOL = 1e-4
GRAD_RTOL = 1e-3  # per gradient tensor

# The README's classification, checked for these families (the anchors) against the models.
ANCHORS = {"mixtral": True, "qwen3_moe": True, "deepseek_v3": True,
           "gpt_oss": False, "gemma4": False}


def _families():
    """Packages of transformers.models whose modeling file uses use_experts_implementation."""
    root = Path(transformers.models.__path__[0])
    found = []
    for info in pkgutil.iter_modules([str(root)]):
        path = root / info.name / f"modeling_{info.name}.py"
        if info.ispkg and path.is_file() and "use_experts_implementation" in path.read_text():
            found.append(info.name)
    return sorted(found)


FAMILIES = _families()

# ------------------------------------------------------------------------------------------------
# Tiny configs: hidden 32, 2 layers, 4 experts, top-2, MoE in every layer where configurable, both
# layer kinds of a hybrid model; the per-family overrides its config validation or RoPE needs.
# ------------------------------------------------------------------------------------------------

TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
            shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=128,
            num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
            num_experts_per_tok=2, moe_topk=2, n_group=2, topk_group=1, first_k_dense_replace=0,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1, output_router_logits=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, router_aux_loss_coef=0.02,
            sliding_window=16, attention_chunk_size=16)

_MLA = dict(num_key_value_heads=4, _drop=["head_dim"])  # multi-head latent attention
OVERRIDES = {
    "deepseek_v2": _MLA, "deepseek_v3": _MLA, "deepseek_v32": _MLA, "axk1": _MLA, "axk2": _MLA,
    "glm4_moe_lite": _MLA, "glm_moe_dsa": _MLA, "mistral4": _MLA, "mistral_large4": _MLA,
    "dots3_note": _MLA,
    "glm5_next": dict(num_key_value_heads=4, index_topk=16, qk_rope_head_dim=0),
    "dots1": dict(n_shared_experts=1),
    "ernie4_5_moe": dict(moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0,
                         moe_layer_end_index=1),
    "ernie4_5_vl_moe": dict(head_dim=16, moe_intermediate_size=[24, 16], moe_k=2,
                            moe_num_shared_experts=1, moe_layer_start_index=0,
                            moe_layer_end_index=1),
    "deepseek_v4": dict(output_router_logits=False, mlp_layer_types=["hash_moe", "moe"]),
    "diffusion_gemma": dict(num_experts=4, top_k_experts=2, moe_intermediate_size=24),
    "gemma4": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24),
    "beam": dict(mlp_layer_types=["sparse", "sparse"]),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"], num_experts_per_tok=2),
    "kimi_linear": dict(mlp_layer_types=["sparse", "sparse"], num_experts_per_token=2,
                        num_key_value_heads=4, _drop=["head_dim"]),
    "bailing_hybrid": dict(num_experts_per_token=2, num_expert_group=2, num_key_value_heads=4),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8,
                             mamba_d_state=16, mamba_chunk_size=8, num_key_value_heads=4),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                      indexer_compress_ratio=4),
    "zaya": dict(num_experts_per_tok=1),
    "unlimited_ocr": dict(num_key_value_heads=4),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
                  expert_layer_offset=0, use_mamba_kernels=False, mamba_dt_rank=4),
    "hy_v4_vl": dict(_mrope=[1, 1, 0]),
    "glm4v_moe": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]}),
}


def model_class(family):
    """The family's *ForCausalLM (not a Thinker/Talker one), else its *TextModel, else *Model."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [n for n, c in vars(module).items()
             if inspect.isclass(c) and c.__module__ == module.__name__]
    for accept in (lambda n: n.endswith("ForCausalLM") and "Talker" not in n
                   and "Thinker" not in n,
                   lambda n: n.endswith("TextModel"),
                   lambda n: n.endswith("Model") and not n.endswith("PreTrainedModel")):
        candidates = [n for n in names if accept(n)]
        if candidates:
            return getattr(module, min(candidates, key=len))
    raise LookupError(f"{family}: no model class")


def tiny_config(cls, family):
    extra = dict(OVERRIDES.get(family, {}))
    drop = list(extra.pop("_drop", []))
    base = cls.config_class().to_dict()
    mrope = extra.pop("_mrope", None)
    if mrope is not None:
        extra["rope_parameters"] = dict(base["rope_parameters"], mrope_section=mrope)
    if base.get("layer_types") and "layer_types" not in extra:  # both layer kinds present
        kinds = base["layer_types"]
        extra["layer_types"] = [kinds[0], next((k for k in kinds if k != kinds[0]), kinds[0])]
    if isinstance(base.get("mlp_layer_types"), list) and "mlp_layer_types" not in extra:
        extra["mlp_layer_types"] = ["sparse", "sparse"]
    if "kv_lora_rank" in base:
        extra.setdefault("num_key_value_heads", 4)
        drop.append("head_dim")
    if "index_n_heads" in base:
        for key, value in dict(index_n_heads=2, index_head_dim=8, index_topk=4).items():
            extra.setdefault(key, value)

    kwargs = {k: v for k, v in TINY.items() if k in base}
    layers = base.get("num_hidden_layers")
    n = extra.get("num_hidden_layers", kwargs.get("num_hidden_layers", layers))
    for key, value in base.items():  # per-layer lists cut to the tiny depth
        if isinstance(value, list) and layers and len(value) == layers and key not in kwargs \
                and key not in extra:
            kwargs[key] = value[:n]
    if base.get("q_lora_rank") is not None:
        kwargs["q_lora_rank"] = 16
    kwargs.update(extra)
    for key in drop:
        kwargs.pop(key, None)
    config = cls.config_class(**kwargs)
    config._attn_implementation = "eager"
    return config


# ------------------------------------------------------------------------------------------------
# Running and comparing
# ------------------------------------------------------------------------------------------------


def train_step(model, ids):
    """(logits or last hidden state, loss, router logits); the loss is backpropagated."""
    model.zero_grad(set_to_none=True)
    try:
        out = model(input_ids=ids, labels=ids)
    except TypeError:  # a *Model without labels: a fixed random projection of the output
        out = model(input_ids=ids)
    if getattr(out, "loss", None) is not None:
        result, loss = out.logits, out.loss
    else:
        result = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        w = torch.randn(result.shape[-1], generator=torch.Generator().manual_seed(5))
        loss = (result * w).sum(-1).square().mean()
    loss.backward()
    router = getattr(out, "router_logits", None)
    if router is not None:
        router = [r.detach() for r in (router if isinstance(router, (tuple, list)) else [router])
                  if r is not None]
    return result.detach(), loss.detach(), router


def original_layout_grads(model):
    """Every parameter's gradient under the original model's names and layouts (w_gate/w_up back
    into gate_up_proj, a transposed layout transposed back)."""
    grads = {n: None if p.grad is None else p.grad.detach() for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if not isinstance(module, mhf.MoeblazeExperts):
            continue
        gate = grads.pop(f"{name}.w_gate")
        if module.gated:
            up = grads.pop(f"{name}.w_up")
            key, fused = "gate_up_proj", None if gate is None else torch.cat([gate, up], dim=1)
        else:
            key, fused = "up_proj", gate
        down = grads[f"{name}.down_proj"]
        if module.is_transposed:
            fused = None if fused is None else fused.transpose(-2, -1)
            down = None if down is None else down.transpose(-2, -1)
        grads[f"{name}.{key}"], grads[f"{name}.down_proj"] = fused, down
    return grads


def relative_error(mine, theirs):
    mine, theirs = mine.double(), theirs.double()
    return float((mine - theirs).abs().max()) / max(float(theirs.abs().max()), 1e-30)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_swapped_matches_or_refused_is_identical(seed, family):
    try:  # transformers' own part: a tiny model that cannot be built is not moeblaze's failure
        cls = model_class(family)
        config = tiny_config(cls, family)
        torch.manual_seed(seed)
        original = cls(config).float().eval()
        swapped = copy.deepcopy(original)
        ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed + 1))
        ref_out, ref_loss, ref_router = train_step(original, ids)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"{family}: transformers could not build/run the tiny model "
                    f"({type(e).__name__}: {str(e)[:200]})")

    found = list(mhf.experts_modules(swapped))
    assert found, f"{family}: no experts module found"
    blockers = {name: mhf.swap_blocker(module) for name, module in found}
    n = mhf.replace_moe_blocks(swapped, strict=False)
    assert n == sum(b is None for b in blockers.values()), blockers
    left = {name for name, _ in mhf.experts_modules(swapped)}
    assert left == {name for name, b in blockers.items() if b is not None}
    if family in ANCHORS:
        assert (n > 0) == ANCHORS[family], f"{family}: README says swapped={ANCHORS[family]}"

    out, loss, router = train_step(swapped, ids)
    mine, theirs = original_layout_grads(swapped), original_layout_grads(original)
    assert mine.keys() == theirs.keys()
    assert {k for k, g in mine.items() if g is None} == {k for k, g in theirs.items() if g is None}
    assert (router is None) == (ref_router is None)

    if n == 0:  # all refused: each with a reason, and the model is the original bit for bit
        for name, reason in blockers.items():
            assert isinstance(reason, str) and reason, name
        assert torch.equal(out, ref_out)
        assert torch.equal(loss, ref_loss)
        for a, b in zip(router or [], ref_router or []):
            assert torch.equal(a, b)
        for name, g in theirs.items():
            assert g is None or torch.equal(mine[name], g), name
        return

    assert relative_error(out, ref_out) <= LOGITS_RTOL
    assert relative_error(loss, ref_loss) <= LOGITS_RTOL
    if router is not None:
        assert len(router) == len(ref_router)
        for a, b in zip(router, ref_router):
            assert relative_error(a, b) <= LOGITS_RTOL
    for name, g in theirs.items():
        if g is None:
            continue
        assert torch.isfinite(mine[name]).all(), name
        error = relative_error(mine[name], g)
        assert error <= GRAD_RTOL, f"{name}: gradient relative error {error:.2e}"


def test_readme_table_classifies_the_anchors():
    """The README's swappable / not swappable columns list the anchors where the models put them."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| mixtral,"))
    swappable, refused = (cell.strip() for cell in row.strip().strip("|").split(" | "))
    words = lambda cell: set(re.findall(r"[a-z0-9_]+", cell))  # noqa: E731
    for family, is_swappable in ANCHORS.items():
        assert family in FAMILIES, family
        assert family in words(swappable if is_swappable else refused), family
        assert family not in words(refused if is_swappable else swappable), family
