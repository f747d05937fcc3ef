"""V100 mode on CPU with a tiny MiniMax-H3 transformer: outputs stay finite (and close to fp32) on inputs where a
plain fp16 model overflows; inf/NaN detection names the layer; weights that do not fit fp16 are named; the W8A16
dequantize path runs in fp16 under the mode."""

import copy
import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

import diffusers_h3._utils as h3_utils
from diffusers_h3 import V100ModeConfig
from diffusers_h3._hooks import H3_V100_MODE_HOOK, hooked_modules
from diffusers_h3.attention_processors.fa_v100 import MiniMaxH3FAV100Processor
from diffusers_h3.hooks.v100_mode import (
    NonFiniteActivationError,
    disable_v100_mode,
    enable_v100_mode,
    pow2_row_scale,
    v100_mode_of,
)
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_transformer_inputs


TINY = TINY_TRANSFORMER_CONFIG


@pytest.fixture(autouse=True)
def quiet_fallback_warnings(monkeypatch):
    monkeypatch.setattr(h3_utils, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="MiniMaxH3FAV100Processor falls back", category=RuntimeWarning)
        warnings.filterwarnings("ignore", message="W8A16Linear", category=RuntimeWarning)
        yield


def _inputs(seed=0, video_scale=1.0, text_scale=1.0):
    return tiny_transformer_inputs(seed, video_scale=video_scale, text_scale=text_scale)


def _model(seed=0, hot=True):
    """Tiny fp32 model; with ``hot`` the first block's FFN sees activations ~1e4 (its pre-FFN norm is scaled), so the
    SwiGLU product reaches ~1e7: finite in fp32, beyond fp16."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():  # random, non-trivial AdaLN / norm weights
            p.add_(torch.randn_like(p) * 0.02)
        if hot:
            model.transformer_blocks[0].norm2.weight.mul_(1e4)
    return model


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def _run(model, inputs):
    out = model(**inputs)
    return out.sample.float(), out.audio_sample.float()


def test_v100_mode_finite_where_plain_half_overflows():
    model = _model()
    inputs = _inputs(video_scale=3e4, text_scale=1e5)  # video rows and text features beyond fp16 after projection
    ref_video, ref_audio = _run(model, inputs)
    assert torch.isfinite(ref_video).all() and torch.isfinite(ref_audio).all()

    plain = copy.deepcopy(model).half()
    plain_video, plain_audio = _run(plain, inputs)
    assert not (torch.isfinite(plain_video).all() and torch.isfinite(plain_audio).all())

    mode = v100_mode_of(enable_v100_mode(model))
    video, audio = _run(model, inputs)
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    assert _rel(video, ref_video) < 2e-2 and _rel(audio, ref_audio) < 2e-2
    # weights: fp16 GEMMs, fp32 kept modules and norms
    assert model.transformer_blocks[0].ff.net[2].weight.dtype == torch.float16
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float16
    assert model.proj_in.weight.dtype == torch.float32 and model.context_embedder.weight.dtype == torch.float32
    assert model.transformer_blocks[0].norm1.weight.dtype == torch.float32
    assert isinstance(model.transformer_blocks[0].attn.processor, MiniMaxH3FAV100Processor)
    line = mode.describe_path()
    assert "V100 mode" in line and "not run on V100 hardware" in line and "SDPA on CPU" in line


def test_v100_mode_matches_fp32_on_ordinary_inputs_with_diffusers_attention():
    model = _model(seed=1, hot=False)
    inputs = _inputs(seed=1)
    ref_video, ref_audio = _run(model, inputs)
    enable_v100_mode(model, V100ModeConfig(attention="keep"))
    video, audio = _run(model, inputs)
    assert _rel(video, ref_video) < 5e-3 and _rel(audio, ref_audio) < 5e-3
    assert type(model.transformer_blocks[0].attn.processor).__name__ == "MiniMaxH3AttnProcessor"


def test_power_of_two_scaling_handles_gemm_inputs_beyond_fp16():
    model = _model(seed=2)
    inputs = _inputs(seed=2)
    with torch.no_grad():
        model.transformer_blocks[0].norm2.weight.mul_(30)  # FFN inputs ~3e5: a plain fp16 cast gives inf
    ref_video, _ = _run(model, inputs)
    assert torch.isfinite(ref_video).all()
    seen = {}
    fc_in = model.transformer_blocks[0].ff.net[0].proj
    # registered before V100 mode's hooks, so it sees the raw (fp32) GEMM input
    fc_in.register_forward_pre_hook(lambda mod, args: seen.__setitem__("amax", args[0].abs().max().item()))
    enable_v100_mode(model)
    video, _ = _run(model, inputs)
    assert seen["amax"] > 65504
    assert torch.isfinite(video).all() and _rel(video, ref_video) < 2e-2


def test_nan_weight_is_named():
    model = _model(seed=3, hot=False)
    enable_v100_mode(model)
    with torch.no_grad():
        model.transformer_blocks[1].attn.to_v.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteActivationError, match=r"transformer_blocks\.1\.attn\.to_v") as info:
        _run(model, _inputs())
    assert info.value.module_name == "transformer_blocks.1.attn.to_v"


def test_overflowing_gemm_output_is_named():
    model = _model(seed=4, hot=False)
    enable_v100_mode(model)
    with torch.no_grad():
        model.transformer_blocks[1].ff.net[2].weight.fill_(6e4)  # fits fp16, the GEMM's sum does not
    with pytest.raises(NonFiniteActivationError, match="fp32_modules") as info:
        _run(model, _inputs())
    assert info.value.module_name == "transformer_blocks.1.ff.net.2"


def test_non_finite_input_is_blamed_upstream():
    model = _model(seed=5, hot=False)
    enable_v100_mode(model)
    inputs = _inputs()
    inputs["encoder_hidden_states"][0, 1, 2] = float("inf")
    with pytest.raises(NonFiniteActivationError, match="upstream") as info:
        _run(model, inputs)
    assert info.value.module_name == "input:encoder_hidden_states"


def test_weight_beyond_fp16_is_named_and_can_stay_fp32():
    model = _model(seed=6, hot=False)
    with torch.no_grad():
        model.transformer_blocks[0].ff.net[0].proj.weight[3, 3] = 1e6
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.ff\.net\.0\.proj\.weight.*fp32_modules"):
        enable_v100_mode(copy.deepcopy(model))
    mode = v100_mode_of(enable_v100_mode(model, V100ModeConfig(fp32_modules=["transformer_blocks.0.ff"])))
    assert model.transformer_blocks[0].ff.net[0].proj.weight.dtype == torch.float32
    assert "transformer_blocks.0.ff" in mode.fp32_modules
    video, _ = _run(model, _inputs())
    assert torch.isfinite(video).all()


def test_remove_and_double_enable():
    model = _model(seed=7, hot=False)
    mode = v100_mode_of(enable_v100_mode(model))
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_v100_mode(model)
    mode.remove()
    assert not model.transformer_blocks[0].attn.to_q._forward_pre_hooks
    disable_v100_mode(enable_v100_mode(model))
    assert v100_mode_of(model) is None and not hooked_modules(model, H3_V100_MODE_HOOK)


def test_bad_arguments():
    with pytest.raises(ValueError, match="attention"):
        enable_v100_mode(_model(hot=False), V100ModeConfig(attention="flash"))
    with pytest.raises(ValueError, match="activation_limit"):
        enable_v100_mode(_model(hot=False), V100ModeConfig(activation_limit=1e6))
    with pytest.raises(TypeError, match="MiniMaxH3Transformer3DModel"):
        enable_v100_mode(torch.nn.Linear(2, 2))


def test_pow2_row_scale():
    x = torch.randn(6, 40)
    x[1] *= 1e5
    x[3] *= 3000
    scale = pow2_row_scale(x, 2048.0)
    assert scale.shape == (6, 1)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    assert ((x / scale).abs().amax(-1) <= 2048).all()
    assert scale[0] == 1 and scale[1] > 1 and scale[3] > 1
    assert ((x / scale).abs().amax(-1)[[1, 3]] > 1024).all()  # the smallest such power


def test_w8a16_dequant_path_runs_in_fp16():
    quantizers = pytest.importorskip("diffusers_h3.quantizers.apply")
    from diffusers_h3.quantizers import is_quantized_linear
    from diffusers_h3.quantizers.config import W8A16Config

    model = _model(seed=8)
    inputs = _inputs(seed=8, video_scale=3e4)
    ref_video, ref_audio = _run(model, inputs)
    quantizers.quantize(model, W8A16Config(backend="dequant"))
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert layers
    enable_v100_mode(model)
    assert all(layer.weight.dtype == torch.float16 for layer in layers)
    assert all(layer.weight.qdata.dtype == torch.int8 for layer in layers)
    video, audio = _run(model, inputs)
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    assert _rel(video, ref_video) < 5e-2 and _rel(audio, ref_audio) < 5e-2


def test_pipeline_enable_v100_mode_end_to_end():
    tiny = pytest.importorskip("diffusers_h3.testing.tiny")
    pipe = tiny.tiny_pipeline(seed=0)
    call = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 22, "num_inference_steps": 2, "output_type": "latent"}
    ref = pipe(**call, generator=torch.Generator().manual_seed(0))
    assert pipe.enable_v100_mode() is pipe
    modes = [v100_mode_of(model) for _, model in pipe._partitions()]
    assert modes and all("V100 mode" in m.describe_path() for m in modes)
    got = pipe(**call, generator=torch.Generator().manual_seed(0))
    for field in ("frames", "audio"):
        a, b = getattr(ref, field), getattr(got, field)
        assert torch.isfinite(b).all()
        assert _rel(b.float(), a.float()) < 1e-3  # CPU: attention stays fp32, only the GEMMs are fp16
