"""Options of the low-precision attention paths that change numerics: each one against the default path and, where
there is one, an independent oracle (fp32 SDPA; the quantization recipe the option names)."""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402

import diffusers_h3._utils as h3_utils  # noqa: E402
from diffusers_h3.attention_processors import MiniMaxH3LowPrecisionAttnProcessor, enable_vsa  # noqa: E402
from diffusers_h3.attention_processors import low_precision as low_precision_module  # noqa: E402

from .test_vsa_processor import _reset, _run, model, rel_l2  # noqa: E402, F401


@pytest.fixture(autouse=True)
def quiet_emulation_warnings(monkeypatch):
    monkeypatch.setattr(h3_utils, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _qkv(seed=0, offset=3.0, n=70):
    """Keys with a large common offset: the case smooth_k exists for (E4M3 scales are spent on the mean)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, 2, 16, generator=g)
    k = torch.randn(1, n, 2, 16, generator=g) + offset * torch.randn(1, 1, 2, 16, generator=g).abs()
    v = torch.randn(1, n, 2, 16, generator=g)
    return q, k, v


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2)
    ).transpose(1, 2)


@pytest.mark.parametrize("precision", ["fp8", "int8", "fp4"])
def test_smooth_k_centres_the_keys_before_quantizing(precision):
    q, k, v = _qkv()
    oracle = _sdpa(q, k, v)
    smooth = MiniMaxH3LowPrecisionAttnProcessor(precision, smooth_k=True).core(q, k, v)
    plain = MiniMaxH3LowPrecisionAttnProcessor(precision, smooth_k=False).core(q, k, v)
    assert not torch.equal(smooth, plain), "smooth_k=False must change the quantized keys"
    # Centring is exact under softmax: running the smooth_k=False path on centred keys is the smooth_k=True path.
    centred = k - k.float().mean(1, keepdim=True)
    plain_on_centred = MiniMaxH3LowPrecisionAttnProcessor(precision, smooth_k=False).core(q, centred, v)
    torch.testing.assert_close(smooth, plain_on_centred, atol=2e-6, rtol=0)
    assert rel_l2(smooth, oracle) < rel_l2(plain, oracle)  # the point of the option: less Q.K error


def test_pv_precision_fp8_quantizes_v():
    q, k, v = _qkv(seed=1, offset=0.0)
    default = MiniMaxH3LowPrecisionAttnProcessor("fp8").core(q, k, v)
    pv8 = MiniMaxH3LowPrecisionAttnProcessor("fp8", pv_precision="fp8").core(q, k, v)
    assert not torch.equal(default, pv8)
    oracle = _sdpa(q, k, v)
    assert rel_l2(pv8, oracle) < 0.15


@pytest.mark.triton_interpreter
def test_fp4_p_changes_the_p_emulation():
    q, k, v = _qkv(seed=2, offset=0.0)
    outs = {p: MiniMaxH3LowPrecisionAttnProcessor("fp4", fp4_p=p).core(q, k, v) for p in ("two_level", "single_level", None)}
    assert not torch.equal(outs["two_level"], outs[None]) and not torch.equal(outs["single_level"], outs[None])
    assert not torch.equal(outs["two_level"], outs["single_level"])
    oracle = _sdpa(q, k, v)
    assert all(rel_l2(out, oracle) < 0.3 for out in outs.values())


@pytest.mark.parametrize("option", [{"smooth_k": False}, {"pv_precision": "fp8"}])
def test_emulated_8bit_dense_path_honours_its_options(monkeypatch, option):
    monkeypatch.setattr(low_precision_module, "_qk_native", lambda *args: False)
    q, k, v = _qkv(seed=3)
    default = MiniMaxH3LowPrecisionAttnProcessor("fp8")
    changed = MiniMaxH3LowPrecisionAttnProcessor("fp8", **option)
    out_default, out_changed = default.core(q, k, v), changed.core(q, k, v)
    assert changed.emulated(q.device)
    assert not torch.equal(out_default, out_changed), f"{option} is reported by describe_path() but has no effect"


def test_emulated_8bit_dense_path_rounds_operands_like_the_kernel(monkeypatch):
    # The emulation's recipe written out: K centred over the sequence, one scale per query row, one per 64-key block
    # and head, one per V channel with pv_precision="fp8"; then exact attention.
    monkeypatch.setattr(low_precision_module, "_qk_native", lambda *args: False)
    q, k, v = _qkv(seed=4)

    def rounded(x, scale_shape_dims, dtype):
        qmax = 448.0 if dtype == torch.float8_e4m3fn else 127.0
        scale = x.abs().amax(dim=scale_shape_dims, keepdim=True).clamp_min(1e-12) * (1.0 / qmax)
        y = (x / scale).clamp(-qmax, qmax)
        y = torch.round(y) if dtype == torch.int8 else y.to(dtype).float()
        return y * scale

    for precision, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        for pv in ("bf16", "fp8"):
            got = MiniMaxH3LowPrecisionAttnProcessor(precision, pv_precision=pv).core(q, k, v)
            kc = k.float() - k.float().mean(1, keepdim=True)
            b, n, h, d = kc.shape
            blocks = torch.nn.functional.pad(kc, (0, 0, 0, 0, 0, (-n) % 64)).view(b, -1, 64, h, d)
            kq = rounded(blocks, (2, 4), dtype).view(b, -1, h, d)[:, :n]
            vq = rounded(v.float(), (1,), torch.float8_e4m3fn) if pv == "fp8" else v.float()
            expected = _sdpa(rounded(q.float(), (-1,), dtype), kq, vq)
            torch.testing.assert_close(got.double(), expected.double(), atol=1e-5, rtol=0)


def test_vsa_smooth_k_and_pv_precision_reach_the_sparse_core(model):  # noqa: F811
    _reset(model)
    results = {}
    for name, options in {"default": {}, "no_smooth": {"smooth_k": False}, "pv8": {"pv_precision": "fp8"}}.items():
        enable_vsa(model, sparsity=0.5, precision="fp8", **options)
        results[name] = _run(model)[0]
    _reset(model)
    dense = _run(model)[0]
    assert not torch.equal(results["default"], results["no_smooth"])
    assert not torch.equal(results["default"], results["pv8"])
    assert all(rel_l2(out, dense) < 0.5 for out in results.values())


def test_vsa_tile_option_changes_the_plan(model):  # noqa: F811
    from diffusers_h3.attention_processors.vsa import VSAConfig

    _reset(model)
    enable_vsa(model, sparsity=0.5)
    default = _run(model)[0]
    enable_vsa(model, sparsity=0.5, tile=(2, 2, 4))
    assert model.transformer_blocks[0].attn.processor.config.tile == (2, 2, 4)
    small = _run(model)[0]
    _reset(model)
    assert VSAConfig().tile == (4, 4, 4)
    assert not torch.equal(default, small)
