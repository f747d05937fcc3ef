"""The ``enable_*`` convention (docs/architecture.md) for the attention entry points: ``enable_vsa``,
``enable_low_precision_attention`` and ``enable_flashinfer_attention`` (and the pipeline method ``pipe.enable_vsa``)
return their target, a pipeline or a transformer; what they installed is read back from the processors with
``vsa_state`` / ``low_precision_attention_state`` / ``flashinfer_attention_state``; ``disable_*`` returns the target."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

import diffusers_h3
from diffusers_h3 import FlashInferAttentionConfig, LowPrecisionAttentionConfig
from diffusers_h3._hooks import partitions_of
from diffusers_h3.attention_processors import (
    MiniMaxH3FlashInferProcessor,
    MiniMaxH3LowPrecisionAttnProcessor,
    MiniMaxH3VSAProcessor,
    VSAConfig,
    disable_flashinfer_attention,
    disable_low_precision_attention,
    disable_vsa,
    enable_flashinfer_attention,
    enable_low_precision_attention,
    enable_vsa,
    flashinfer_attention_state,
    low_precision_attention_state,
    vsa_state,
)
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_pipeline


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=3)


@pytest.fixture
def flashinfer_on_hopper(monkeypatch, flashinfer_stand_in):
    """The FlashInfer glue on the CPU: the stand-in package, and every device read as an SM90 GPU."""
    from diffusers_h3.attention_processors import flashinfer as flashinfer_processors

    monkeypatch.setattr(flashinfer_processors, "cuda_capability", lambda device=None: (9, 0))
    return flashinfer_stand_in


def _model():
    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()


def _models(target):
    return [m for _, m in partitions_of(target)]


def _processors(model):
    return [block.attn.processor for block in model.transformer_blocks]


# (enable, config, accessor, disable, processor class): every converted entry point.
ENTRY_POINTS = {
    "vsa": (enable_vsa, VSAConfig(sparsity=0.5, dense_layers=(1,), dense_first_steps=2), vsa_state, disable_vsa,
            MiniMaxH3VSAProcessor),
    "low_precision": (enable_low_precision_attention, LowPrecisionAttentionConfig("int8"), low_precision_attention_state,
                      disable_low_precision_attention, MiniMaxH3LowPrecisionAttnProcessor),
    "flashinfer": (enable_flashinfer_attention, FlashInferAttentionConfig(precision="bf16"), flashinfer_attention_state,
                   disable_flashinfer_attention, MiniMaxH3FlashInferProcessor),
}  # fmt: skip


@pytest.mark.parametrize("form", ["model", "pipeline"])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_enable_and_disable_return_their_target(entry, form, request, pipe):
    """Fails when a converted ``enable_*`` / ``disable_*`` returns anything but its argument (a summary, ``None``)."""
    if entry == "flashinfer":
        request.getfixturevalue("flashinfer_on_hopper")
    enable, config, state_of, disable, cls = ENTRY_POINTS[entry]
    target = _model() if form == "model" else pipe
    models = _models(target)
    assert models and (form == "model" or len(models) == 2)  # the tiny pipeline: transformer and transformer_ref
    returned = enable(target, config)
    assert returned is target, f"{enable.__name__} returned {type(returned).__name__}, not its target"
    for model in models:
        assert all(type(p) is cls for p in _processors(model))
        assert state_of(model)["blocks"] == len(model.transformer_blocks)
    returned = disable(target)
    assert returned is target, f"{disable.__name__} returned {type(returned).__name__}, not its target"
    for model in models:
        assert all(type(p) is MiniMaxH3AttnProcessor for p in _processors(model))
        assert state_of(model) is None


def test_pipeline_method_enable_vsa_returns_the_pipeline(pipe):
    assert pipe.enable_vsa(sparsity=0.5) is pipe
    assert [vsa_state(m)["sparsity"] for m in _models(pipe)] == [0.5, 0.5]
    assert disable_vsa(pipe) is pipe and vsa_state(pipe.transformer) is None


def test_vsa_state_reports_the_old_summary():
    model = _model()
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), dense_layers=[1], dense_first_steps=2, precision="fp8")
    state = vsa_state(model)
    first = model.transformer_blocks[0].attn.processor
    # The keys enable_vsa returned before it returned the model, with the same values.
    assert state == {**state, "blocks": 2, "sparse_blocks": 1, "dense_layers": [1], "dense_first_steps": 2,
                     "gated_blocks": 0, "precision": "fp8", "path": first.describe_path()}  # fmt: skip
    assert state["sparsity"] == 0.75 and state["tile"] == (2, 2, 4)
    diffusers_h3.add_gate_compress(model)  # a zero gate on every block
    assert vsa_state(model)["gated_blocks"] == 2
    # Another processor on the blocks: no VSA state.
    assert enable_low_precision_attention(model, LowPrecisionAttentionConfig("fp8")) is model
    assert vsa_state(model) is None


def test_low_precision_attention_state_reports_the_old_summary():
    model = _model()
    assert low_precision_attention_state(model) is None
    enable_low_precision_attention(model, LowPrecisionAttentionConfig("fp4", smooth_k=False, fp4_p="single_level",
                                                                      backend="torch"))  # fmt: skip
    state = low_precision_attention_state(model)
    first = model.transformer_blocks[0].attn.processor
    assert state == {"blocks": 2, "precision": "fp4", "smooth_k": False, "pv_precision": "bf16",
                     "fp4_p": "single_level", "strict": False, "backend": "torch", "kernel": "auto",
                     "path": first.describe_path()}  # fmt: skip
    # VSA processors delegate their dense calls to a low-precision core, but are not this entry point's state.
    enable_vsa(model, sparsity=0.0, precision="fp8")
    assert low_precision_attention_state(model) is None


def test_flashinfer_attention_state_reports_the_old_summary(flashinfer_on_hopper):
    from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_kernel_source

    model = _model().to(torch.bfloat16)
    assert flashinfer_attention_state(model) is None
    enable_flashinfer_attention(model, FlashInferAttentionConfig(precision="fp8"))
    first = model.transformer_blocks[0].attn.processor
    assert flashinfer_attention_state(model) == {
        "blocks": 2, "backend": "fa3", "precision": "fp8", "kernels": flashinfer_kernel_source(),
        "path": first.describe_path(),
    }  # fmt: skip
    assert flashinfer_attention_state(model)["kernels"].startswith("built on first use with")


def test_accessors_read_what_ran(flashinfer_on_hopper):
    """The state is the processors': after a call, ``path`` names the kernel that ran (the old summary, taken when
    installing, said it would be chosen on the first call)."""
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    model = _model()
    enable_low_precision_attention(model, LowPrecisionAttentionConfig("int8", backend="torch"))
    before = low_precision_attention_state(model)["path"]
    with torch.no_grad():
        model(**tiny_transformer_inputs(seed=3))
    after = low_precision_attention_state(model)["path"]
    assert "chosen on the first call" in before and "chosen on the first call" not in after


def test_loose_arguments_still_work_for_one_release_with_a_future_warning(flashinfer_on_hopper):
    """The ``enable_*`` hooks take one config object; the loose arguments they took before install the same thing,
    with one ``FutureWarning`` naming the new call. Fails if a loose argument is dropped, silently accepted, or no
    longer equal to its config field."""
    cases = [
        (enable_low_precision_attention, ("fp4",), {"smooth_k": False, "backend": "torch"},
         LowPrecisionAttentionConfig("fp4", smooth_k=False, backend="torch"), low_precision_attention_state),
        (enable_flashinfer_attention, (), {"precision": "fp8"}, FlashInferAttentionConfig(precision="fp8"),
         flashinfer_attention_state),
    ]  # fmt: skip
    for enable, args, kwargs, config, state_of in cases:
        new, old = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
        enable(new, config)
        with pytest.warns(FutureWarning, match=rf"{enable.__name__}\(target, {type(config).__name__}\("):
            assert enable(old, *args, **kwargs) is old
        assert state_of(old) == state_of(new)
    with pytest.raises(TypeError, match="unexpected argument"):
        enable_low_precision_attention(_model(), precisionn="fp8")
    for module in (diffusers_h3.FastVAEDecodeConfig, diffusers_h3.V100ModeConfig, diffusers_h3.SpeedPresetConfig,
                   diffusers_h3.MemoryBudgetConfig):  # fmt: skip
        assert module.__dataclass_params__.frozen, module


def test_loose_arguments_next_to_a_config_change_only_their_fields(flashinfer_on_hopper):
    """A config object with loose keyword arguments next to it (``enable(target, config, field=value)``, the
    transition's mixed call): the loose values replace their fields and every other field keeps the config's value,
    with the ``FutureWarning``. Fails if the shim builds the config from the loose arguments alone (dropping the
    object) or ignores them."""
    cases = [
        (enable_low_precision_attention, LowPrecisionAttentionConfig("int8", smooth_k=False, backend="torch"),
         {"pv_precision": "fp8"}, low_precision_attention_state),
        (enable_flashinfer_attention, FlashInferAttentionConfig(precision="fp8"), {"backend": "fa3"},
         flashinfer_attention_state),
    ]  # fmt: skip
    for enable, config, loose, state_of in cases:
        expected_config = type(config)(**{**config.__dict__, **loose})
        assert expected_config != config and expected_config != type(config)(**loose)  # the case tells them apart
        new, mixed = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
        enable(new, expected_config)
        with pytest.warns(FutureWarning, match=rf"{enable.__name__}\(target, {type(config).__name__}\("):
            assert enable(mixed, config, **loose) is mixed
        assert state_of(mixed) == state_of(new)
    # the loose precision by position after a config object: it replaces the config's precision, nothing else
    mixed = _model()
    with pytest.warns(FutureWarning):
        enable_low_precision_attention(mixed, LowPrecisionAttentionConfig("int8", smooth_k=False, backend="torch"),
                                       "fp8")  # fmt: skip
    state = low_precision_attention_state(mixed)
    assert (state["precision"], state["smooth_k"], state["backend"]) == ("fp8", False, "torch")
