"""VSA over groups of heads (``VSAConfig.head_groups`` / ``set_vsa_head_groups``): the same output bit for bit as one
call over all heads, for every precision and with the coarse gate, while each call of the op sees only its group."""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor  # noqa: E402

from diffusers_h3.attention_processors import vsa as vsa_module  # noqa: E402
from diffusers_h3.attention_processors.vsa import VSAConfig, enable_vsa, set_vsa_head_groups, vsa_state  # noqa: E402
from diffusers_h3.layout import use_packed_layout  # noqa: E402
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG  # noqa: E402

from .test_vsa_processor import _inputs, _layout  # noqa: E402


# Five heads (an odd count: groups of unequal size) of 32 channels; the rest as the tiny model.
CONFIG = {**TINY_TRANSFORMER_CONFIG, "num_attention_heads": 5, "attention_head_dim": 32, "hidden_size": 32}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MiniMaxH3Transformer3DModel(**CONFIG).eval().to(DEVICE)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in m.transformer_blocks:  # peaky, per-head different scores: tile selection differs by head
            block.attn.norm_q.weight.copy_(torch.rand(32, generator=g) * 4 + 1)
    return m


@pytest.fixture()
def op_calls(monkeypatch):
    """The heads of every call of the VSA op."""
    heads = []
    real = vsa_module.vsa_attention_op

    def spy(query, *args):
        heads.append(query.shape[2])
        return real(query, *args)

    monkeypatch.setattr(vsa_module, "vsa_attention_op", spy)
    return heads


def _run(model):
    with torch.no_grad(), use_packed_layout(_layout()):
        return model(**_inputs())[0]


@pytest.fixture()
def poisoned_empty(monkeypatch):
    """``torch.empty`` filled with NaN while the test runs: an output slice no group writes shows up."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("precision", ["bf16", "int8", "fp8", "fp4"])
def test_head_groups_give_the_same_output_bit_for_bit(model, op_calls, poisoned_empty, precision):
    backend = "torch" if precision == "fp4" else "auto"
    enable_vsa(model, VSAConfig(sparsity=0.5, tile=(2, 2, 4), precision=precision, backend=backend))
    try:
        whole = _run(model)
        assert op_calls and set(op_calls) == {5}
        op_calls.clear()
        enable_vsa(model, VSAConfig(sparsity=0.5, tile=(2, 2, 4), precision=precision, backend=backend, head_groups=3))
        grouped = _run(model)
    finally:
        model.set_attn_processor(MiniMaxH3AttnProcessor())
    blocks = len(model.transformer_blocks)
    assert op_calls == [1, 2, 2] * blocks  # 5 heads in 3 groups: 5*g//3 bounds 0, 1, 3, 5
    assert torch.equal(grouped, whole) and torch.isfinite(grouped).all()
    assert whole.abs().sum() > 0


def test_the_transformer_setting_is_the_default_and_a_config_overrides_it(model, op_calls):
    set_vsa_head_groups(model, 2)
    try:
        # a registry hook's record (diffusers_h3._hooks), not an attribute stamped on the module
        assert vsa_module.vsa_head_groups_of(model) == 2
        assert not [a for a in vars(model) if a.startswith(("_h3_", "_diffusers_h3_"))]
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4))
        assert vsa_state(model)["head_groups"] == 2
        assert "2 head groups in turn" in vsa_state(model)["path"]
        _run(model)
        assert set(op_calls) == {2, 3}
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), head_groups=1)
        assert vsa_state(model)["head_groups"] == 1
        set_vsa_head_groups(model, None)
        assert vsa_module.vsa_head_groups_of(model) is None
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4))
        assert vsa_state(model)["head_groups"] == 1
    finally:
        set_vsa_head_groups(model, None)
        model.set_attn_processor(MiniMaxH3AttnProcessor())


def test_more_groups_than_heads_runs_one_head_per_call(model, op_calls):
    enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), head_groups=64)
    try:
        _run(model)
    finally:
        model.set_attn_processor(MiniMaxH3AttnProcessor())
    assert set(op_calls) == {1} and len(op_calls) == 5 * len(model.transformer_blocks)


def test_gated_blocks_group_their_gate_too(model):
    heads, d, hidden = 5, 32, CONFIG["hidden_size"]
    g = torch.Generator().manual_seed(1)
    state = {"transformer_blocks.0.attn.to_gate_compress.weight": torch.randn(heads * d, hidden, generator=g),
             "transformer_blocks.0.attn.to_gate_compress.bias": torch.randn(heads * d, generator=g)}
    assert vsa_module.add_gate_compress(model, state) == (0,)
    try:
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4))
        whole = _run(model)
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), head_groups=2)
        grouped = _run(model)
        del model.transformer_blocks[0].attn.to_gate_compress
        plain = _run(model)
    finally:
        model.transformer_blocks[0].attn.__dict__.get("_modules", {}).pop("to_gate_compress", None)
        model.set_attn_processor(MiniMaxH3AttnProcessor())
    assert torch.equal(grouped, whole)
    assert not torch.equal(plain, whole)  # the gate mattered, so its grouping was exercised


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_head_groups_are_refused_in_one_line(model, bad):
    with pytest.raises(ValueError, match="head_groups must be a positive int"):
        VSAConfig(head_groups=bad)
    with pytest.raises(ValueError, match="head_groups must be a positive int"):
        set_vsa_head_groups(model, bad)


@pytest.mark.triton_interpreter
def test_head_groups_compile_to_one_graph_per_block_with_one_op_call_per_group():
    """Under ``compile_repeated_blocks(fullgraph=True)`` the group loop unrolls into the block's one graph: the VSA op
    once per group, the eager output, and no recompilation for the next step."""
    import torch._dynamo

    from diffusers_h3.testing.tiny import tiny_transformer

    from ..pipelines.test_compile_fullgraph import KERNELS_ON_CPU, compile_blocks_and_rerun

    torch.manual_seed(0)
    model = tiny_transformer()
    enable_vsa(model, sparsity=0.5, head_groups=2)
    eager, compiled, again, recorder = compile_blocks_and_rerun(model)
    per_graph = [sum(node.op == "call_function" and "vsa_attention" in str(node.target) for node in gm.graph.nodes)
                 for gm in recorder.aten_graphs]  # fmt: skip
    # the transformer block's graph calls the op per group; the token refiner's (dense SDPA) none
    assert (2 in per_graph and set(per_graph) <= {0, 2}) or not KERNELS_ON_CPU, (per_graph, sorted(recorder.ops()))
    for got, ref in zip(compiled, eager):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert again[0].shape == eager[0].shape
    torch._dynamo.reset()
