"""MiniMaxH3VSAProcessor on the tiny H3 transformer: dense equivalence, sparse semantics, gates, options, errors."""

import math
import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor  # noqa: E402

from diffusers_h3.attention_processors import install_call_plan_hook  # noqa: E402
from diffusers_h3.attention_processors import low_precision as low_precision_module  # noqa: E402
from diffusers_h3.attention_processors.tiling import build_tile_plan  # noqa: E402
from diffusers_h3.attention_processors.vsa import (  # noqa: E402
    MiniMaxH3VSAProcessor,
    add_gate_compress,
    disable_vsa,
    enable_vsa,
    vsa_attention,
    vsa_state,
)
from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout  # noqa: E402
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG


TINY = TINY_TRANSFORMER_CONFIG
GRID = (3, 5, 6)  # partial 2x2x4 tiles in every axis
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _layout(step=None, steps=None):
    # ref2va-style: audio and text around the target video, not in the canonical order.
    n_video = math.prod(GRID)
    segs = [
        LayoutSegment("audio", "target", 0, 9, channels=2),
        LayoutSegment("video", "target", 9, 9 + n_video, grid=GRID),
        LayoutSegment("text", "prompt", 9 + n_video, 9 + n_video + 7),
    ]
    return PackedLayout(tuple(segs), seq_len=9 + n_video + 7, step_index=step, num_steps=steps)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n_video = math.prod(GRID)
    seq = 9 + n_video + 7
    audio_idx = torch.arange(0, 9)
    video_idx = torch.arange(9, 9 + n_video)
    text_idx = torch.arange(9 + n_video, seq)
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text_idx], tags[audio_idx] = 1, 2
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in GRID), indexing="ij")
    pos = torch.zeros(seq, 3, dtype=torch.long)
    pos[video_idx] = torch.stack([t, h, w], -1).reshape(-1, 3)
    pos[audio_idx, 0] = torch.arange(9)
    pos[text_idx, 0] = torch.arange(7)
    inputs = {
        "hidden_states": torch.randn(1, n_video, 16, generator=g),
        "audio_hidden_states": torch.randn(1, 9, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, 7, 16, generator=g),
        "timestep": torch.tensor([0.7]),
        "timestep_indices": torch.zeros(seq, dtype=torch.long),
        "token_tags": tags,
        "position_ids": pos,
        "video_indices": video_idx,
        "audio_indices": audio_idx,
        "text_indices": text_idx,
    }
    return {**{k: v.to(DEVICE) for k, v in inputs.items()}, "return_dict": False}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MiniMaxH3Transformer3DModel(**TINY).eval().to(DEVICE)
    # Sharpen attention so that sparse selection matters (random tiny weights give near-uniform softmax).
    with torch.no_grad():
        for block in m.transformer_blocks:
            block.attn.norm_q.weight.mul_(4.0)
    return m


def _run(model, layout=None, **kwargs):
    with torch.no_grad(), use_packed_layout(layout if layout is not None else _layout()):
        return model(**_inputs(**kwargs))


def _reset(model):
    model.set_attn_processor(MiniMaxH3AttnProcessor())
    for block in model.transformer_blocks:
        if hasattr(block.attn, "to_gate_compress"):
            del block.attn.to_gate_compress


def test_sparsity_zero_equals_default_processor(model):
    _reset(model)
    ref = _run(model)
    enable_vsa(model, sparsity=0.0)
    out = _run(model)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    _reset(model)


def test_all_tiles_selected_equals_dense(model):
    _reset(model)
    ref = _run(model)
    assert enable_vsa(model, sparsity=0.001, tile=(2, 2, 4)) is model  # keeps every video tile
    state = vsa_state(model)
    assert state["sparse_blocks"] == 2 and "VSA" in state["path"]
    out = _run(model)
    assert rel_l2(out[0], ref[0]) < 1e-5 and rel_l2(out[1], ref[1]) < 1e-5
    _reset(model)


def _brute_force_vsa(q, k, v, layout, tile, sparsity):
    """VSA from its definition, tile by tile, with tiles found from coordinates (independent of tiling.py)."""
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    hh, d = q.shape[2], q.shape[3]
    groups = []  # (is_video, rows)
    for seg in layout.segments:
        if seg.kind == "video" and seg.role == "target":
            t_, h_, w_ = seg.grid
            cubes = {}
            for r in range(seg.start, seg.stop):
                i = r - seg.start
                t, h, w = i // (h_ * w_), (i // w_) % h_, i % w_
                cubes.setdefault((t // tile[0], h // tile[1], w // tile[2]), []).append(r)
            groups += [(True, cubes[c]) for c in sorted(cubes)]
        else:
            vol = math.prod(tile)
            groups += [(False, list(range(a, min(a + vol, seg.stop)))) for a in range(seg.start, seg.stop, vol)]
    video = [i for i, (is_v, _) in enumerate(groups) if is_v]
    keep = min(max(math.ceil(round((1 - sparsity) * len(video), 6)), 1), len(video))
    out = torch.empty(q.shape, dtype=torch.float32)
    for head in range(hh):
        qp = torch.stack([q[0, rows, head].float().mean(0) for _, rows in groups])
        kp = torch.stack([k[0, rows, head].float().mean(0) for _, rows in groups])
        scores = qp @ kp.T / math.sqrt(d)
        for i, (is_v, rows) in enumerate(groups):
            if is_v:
                chosen = [j for j in range(len(groups)) if not groups[j][0]]
                vs = torch.tensor(video)
                chosen += vs[scores[i, vs].topk(keep).indices].tolist()
            else:
                chosen = list(range(len(groups)))
            cols = sorted(r for j in chosen for r in groups[j][1])
            att = torch.softmax(q[0, rows, head].float() @ k[0, cols, head].float().T / math.sqrt(d), -1)
            out[0, rows, head] = att @ v[0, cols, head].float()
    return out


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_interpreter)])
def test_vsa_core_matches_brute_force(backend):
    layout = _layout()
    plan = build_tile_plan(layout, tile=(2, 2, 4), device=DEVICE)
    q = torch.randn(1, layout.seq_len, 2, 32, device=DEVICE) * 2
    k, v = torch.randn_like(q), torch.randn_like(q)
    out, coarse = vsa_attention(q, k, v, plan, sparsity=0.7, backend=backend)
    assert coarse is None
    ref = _brute_force_vsa(q, k, v, layout, (2, 2, 4), 0.7)
    assert rel_l2(out.cpu(), ref) < 1e-5
    dense = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert rel_l2(out, dense) > 1e-3  # sparsity actually dropped something


def test_sparse_differs_and_dense_first_steps_and_layers(model):
    _reset(model)
    ref = _run(model)
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), dense_first_steps=2)
    assert torch.equal(_run(model, _layout(step=1, steps=4))[0], ref[0])
    sparse = _run(model, _layout(step=2, steps=4))[0]
    assert 1e-4 < rel_l2(sparse, ref[0]) < 0.5
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), dense_layers=[0, 1])
    assert torch.equal(_run(model)[0], ref[0])
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), dense_layers=[1])
    one = _run(model)[0]
    assert not torch.equal(one, ref[0]) and not torch.equal(one, sparse)
    disable_vsa(model)
    assert torch.equal(_run(model)[0], ref[0])


def test_gate_compress_zero_is_pure_sparse_and_trained_gate_adds_coarse(model):
    # Gate semantics, through the torch references of the kernels (the Triton kernels run through the processor in
    # test_vsa_core_matches_brute_force and the kernel tests; under the CPU interpreter they cost ~20 s here).
    _reset(model)
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), backend="torch")
    pure = _run(model)[0]
    keys = [f"transformer_blocks.{i}.attn.to_gate_compress.weight" for i in range(2)]
    assert add_gate_compress(model, keys) == (0, 1)
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), backend="torch")
    assert vsa_state(model)["gated_blocks"] == 2
    assert torch.equal(_run(model)[0], pure)  # zero gates: exactly pure sparse
    state = {f"transformer_blocks.{i}.attn.to_gate_compress.weight": torch.randn(64, 32, device=DEVICE) * 0.5
             for i in range(2)}
    state["transformer_blocks.1.attn.to_gate_compress.bias"] = torch.randn(64, device=DEVICE)
    add_gate_compress(model, state)
    assert model.transformer_blocks[1].attn.to_gate_compress.bias is not None
    assert torch.equal(model.transformer_blocks[0].attn.to_gate_compress.weight, state[keys[0]])
    gated = _run(model)[0]
    assert rel_l2(gated, pure) > 1e-3
    # The state dict now loads strictly into the model (the keys exist).
    model.load_state_dict({**model.state_dict(), **state}, strict=True)
    _reset(model)


def test_gate_combination_matches_manual():
    layout = _layout()
    plan = build_tile_plan(layout, tile=(2, 2, 4))
    q = torch.randn(1, layout.seq_len, 2, 32)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out, coarse = vsa_attention(q, k, v, plan, sparsity=0.5, compress=True, backend="torch")
    # Coarse branch: softmax over pooled tiles, independent recomputation for one tile.
    t = int(plan.row_tile[20])
    rows = [r for r in range(layout.seq_len) if int(plan.row_tile[r]) == t]
    tiles = [[r for r in range(layout.seq_len) if int(plan.row_tile[r]) == j] for j in range(plan.num_tiles)]
    qp = q[0, rows, 1].mean(0)
    kp = torch.stack([k[0, m, 1].mean(0) for m in tiles])
    vp = torch.stack([v[0, m, 1].mean(0) for m in tiles])
    expected = torch.softmax(kp @ qp / math.sqrt(32), 0) @ vp
    torch.testing.assert_close(coarse[0, 1, t], expected, rtol=1e-4, atol=1e-5)


def test_low_precision_paths_are_close_but_not_exact(model):
    # The numerics of each precision, through the kernels' torch references (same numerics as the Triton kernels,
    # tested against them in tests/kernels/; under the CPU interpreter these seven model runs cost ~50 s).
    _reset(model)
    ref = _run(model)[0]
    errors = {}
    for precision, sparsity in [("fp8", 0.0), ("fp8", 0.001), ("int8", 0.0), ("int8", 0.001), ("fp4", 0.001),
                                ("fp4", 0.0)]:
        enable_vsa(model, sparsity=sparsity, tile=(2, 2, 4), precision=precision, backend="torch")
        errors[precision, sparsity] = rel_l2(_run(model)[0], ref)
    enable_vsa(model, sparsity=0.001, tile=(2, 4, 4), precision="fp8", pv_precision="fp8",
               backend="torch")  # FP8 P.V: >= 32 rows
    errors["fp8pv"] = rel_l2(_run(model)[0], ref)
    for key, err in errors.items():
        assert 1e-6 < err < (0.25 if "fp4" in key else 0.08), (key, err)
    assert errors["int8", 0.001] < errors["fp8", 0.001]  # INT8 Q/K rounds ~4x finer than E4M3
    _reset(model)


def test_errors_and_describe(model):
    _reset(model)
    enable_vsa(model, sparsity=0.8)
    with torch.no_grad(), pytest.raises(RuntimeError, match="use_packed_layout"):
        model(**_inputs())
    # The refiner (rotary_emb=None) stays dense and needs no layout.
    proc = MiniMaxH3VSAProcessor(sparsity=0.8)
    attn = model.token_refiner.refiner_blocks[0].attn
    x = torch.randn(1, 5, 32, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(proc(attn, x), MiniMaxH3AttnProcessor()(attn, x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="sparsity"):
        MiniMaxH3VSAProcessor(sparsity=1.0)
    with pytest.raises(ValueError, match="precision"):
        MiniMaxH3VSAProcessor(precision="int4")
    with pytest.raises(ValueError, match="pv_precision"):
        MiniMaxH3VSAProcessor(precision="bf16", pv_precision="fp8")
    MiniMaxH3VSAProcessor(precision="int8", pv_precision="fp8")  # INT8 Q/K with E4M3 P.V is a valid mix
    with pytest.raises(ValueError, match="32"):
        MiniMaxH3VSAProcessor(precision="fp8", pv_precision="fp8", tile=(2, 2, 4))
    with pytest.raises(ValueError, match="kernel must be"):
        MiniMaxH3VSAProcessor(kernel="cuda")
    # describe_path reports what ran (recorded by the router), never a guess before the first call.
    assert "chosen on the first sparse call" in MiniMaxH3VSAProcessor(kernel="sm90").describe_path()
    with pytest.raises(ValueError, match="dense_layers"):
        enable_vsa(model, dense_layers=[7])
    with pytest.raises(NotImplementedError, match="strict=False"):
        MiniMaxH3VSAProcessor(precision="fp4", strict=True)
    # Ring attention is refused with one clear error (the base's policy).
    proc = MiniMaxH3VSAProcessor(sparsity=0.5)
    cp = type("CP", (), {"ring_degree": 2, "ulysses_degree": 1})()
    proc._parallel_config = type("P", (), {"context_parallel_config": cp})()
    blk = model.transformer_blocks[0].attn
    with pytest.raises(NotImplementedError, match="ring attention needs a backend with LSE; use ulysses_degree"):
        proc(blk, torch.randn(1, 5, 32, device=DEVICE), rotary_emb=(torch.ones(5, 24), torch.zeros(5, 24)))
    assert "VSA sparsity=0.8" in MiniMaxH3VSAProcessor(sparsity=0.8, layer_index=3).describe_path()
    assert "dense" in MiniMaxH3VSAProcessor(sparsity=0.0).describe_path()
    assert "not run on hardware" in MiniMaxH3VSAProcessor(precision="fp4").describe_path()
    _reset(model)


@pytest.mark.parametrize("precision,name,format_name", [("fp8", "FP8", "FP8 E4M3"), ("int8", "INT8", "INT8")])
def test_8bit_without_tensor_cores_warns_or_raises(model, monkeypatch, precision, name, format_name, h3_logs):
    _reset(model)
    assert f"{format_name} Q per token" in MiniMaxH3VSAProcessor(precision=precision).describe_path()
    assert "emulated" not in MiniMaxH3VSAProcessor(precision=precision).describe_path()  # nothing ran yet
    monkeypatch.setattr(low_precision_module, "_qk_native", lambda precision, device: False)
    with pytest.raises(RuntimeError, match=f"{name} tensor cores.*strict=False"):
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), precision=precision, strict=True)
    enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), precision=precision, backend="torch")  # the warning, not the kernel
    from diffusers_h3 import _utils

    _utils._WARNED.clear()
    with h3_logs.expect(f"{name} attention runs as emulation"):
        out = _run(model)[0]
    assert torch.isfinite(out).all()
    assert f"emulated here: no {name} tensor cores" in model.transformer_blocks[0].attn.processor.describe_path()
    _reset(model)
    monkeypatch.setattr(low_precision_module, "_fp8_native", lambda device: False)
    with pytest.raises(RuntimeError, match="strict=False"):
        enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), precision="fp8", strict=True)
    enable_vsa(model, sparsity=0.5, tile=(2, 2, 4), precision="fp8", backend="torch")
    from diffusers_h3 import _utils

    _utils._WARNED.clear()
    with h3_logs.expect("emulation"):
        out = _run(model)[0]
    assert torch.isfinite(out).all()
    assert "emulated" in model.transformer_blocks[0].attn.processor.describe_path()
    _reset(model)


def test_vsa_config_validates_once_with_one_clear_line():
    from diffusers_h3.attention_processors import VSAConfig

    for options, error, match in [
        ({"sparsity": 1.0}, ValueError, r"sparsity must be a float in \[0, 1\)"),
        ({"sparsity": True}, ValueError, "sparsity"),
        ({"tile": (3, 4, 4)}, ValueError, "power-of-two volume"),
        ({"precision": "int4"}, ValueError, "precision must be one of"),
        ({"pv_precision": "fp8"}, ValueError, "pv_precision='fp8' needs precision='fp8' or 'int8'"),
        ({"dense_first_steps": -1}, ValueError, "dense_first_steps must be >= 0"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"fp4_p": "three_level"}, ValueError, "fp4_p must be"),
        ({"precision": "fp4", "strict": True}, NotImplementedError, "strict=False"),
    ]:
        with pytest.raises(error, match=match) as info:
            VSAConfig(**options)
        assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match=r"unknown VSA option\(s\) \['sparsty'\]"):
        MiniMaxH3VSAProcessor(sparsty=0.5)
    config = VSAConfig(sparsity=0.5, tile=[2, 2, 4], dense_layers=[3, 1, 3])
    assert config.tile == (2, 2, 4) and config.dense_layers == (1, 3) and config.block == 16
    proc = MiniMaxH3VSAProcessor(config, precision="int8", layer_index=1)
    assert proc.config == VSAConfig(sparsity=0.5, tile=(2, 2, 4), dense_layers=(1, 3), precision="int8")
    assert proc.layer_dense and proc.sparsity == 0.5


def test_enable_vsa_takes_a_config(model):
    from diffusers_h3.attention_processors import VSAConfig

    _reset(model)
    enable_vsa(model, sparsity=0.75, tile=(2, 2, 4), backend="torch")
    by_keywords = _run(model)[0]
    enable_vsa(model, VSAConfig(sparsity=0.75, tile=(2, 2, 4), backend="torch"))
    assert vsa_state(model)["sparse_blocks"] == 2
    assert torch.equal(_run(model)[0], by_keywords)
    enable_vsa(model, VSAConfig(sparsity=0.75), tile=(2, 2, 4))  # keywords replace fields of the config
    assert model.transformer_blocks[0].attn.processor.config.tile == (2, 2, 4)
    _reset(model)


@pytest.mark.triton_interpreter
def test_describe_reports_the_recorded_kernel_choice(model, monkeypatch):
    """describe_path says what the router ran; with a (faked) Hopper GPU, inputs it cannot take still say Triton."""
    from diffusers_h3 import describe
    from diffusers_h3.kernels.attention import router

    _reset(model)
    if DEVICE == "cpu":
        monkeypatch.setattr(router, "sm90_available_for", lambda device: True)
    enable_vsa(model, sparsity=0.5, tile=(2, 4, 4), backend="triton")  # 32-row tiles
    _run(model)
    proc = model.transformer_blocks[0].attn.processor
    choice = proc.last_choice
    assert choice is not None and choice.kernel == "triton" and "Hopper kernel does not run this" in choice.reason
    line = proc.describe_path()
    assert choice.describe() in line and "sm90" not in line and "Hopper Gluon" not in line
    assert line in describe(model)["model"]["attention"]
    _reset(model)


def _vsa_grads(install, checkpointing, checkpointing_first=True, hook=True, checkpoint_func=None, **options):
    """Gradients of a small loss of the tiny transformer with sparse VSA installed by ``install``; backward runs after
    the layout context has exited, as in a training loop. ``hook``: register the call-plan hook for a processor set by
    hand (``enable_vsa`` always does); ``checkpoint_func``: the model's checkpoint function (diffusers' default: None)."""
    torch.manual_seed(0)
    m = MiniMaxH3Transformer3DModel(**TINY).to(DEVICE).train()
    if checkpointing and checkpointing_first:
        m.enable_gradient_checkpointing(checkpoint_func)
    if install == "enable_vsa":
        enable_vsa(m, sparsity=0.5, **options)
    else:  # the processor on its own, one instance for every attention module (refiner included)
        m.set_attn_processor(MiniMaxH3VSAProcessor(sparsity=0.5, **options))
        if hook:
            install_call_plan_hook(m)
    if checkpointing and not checkpointing_first:
        m.enable_gradient_checkpointing(checkpoint_func)
    with use_packed_layout(_layout()):
        video, audio = m(**_inputs(seed=3))
    (video.square().mean() + audio.square().mean()).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing_first", [False, True])
def test_sparse_vsa_under_gradient_checkpointing_gives_the_same_gradients(checkpointing_first):
    plain = _vsa_grads("enable_vsa", checkpointing=False)
    checkpointed = _vsa_grads("enable_vsa", checkpointing=True, checkpointing_first=checkpointing_first)
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_vsa_installed_with_set_attn_processor_keeps_its_layout_under_gradient_checkpointing():
    """set_attn_processor (no enable_vsa) trains with checkpointing once the call-plan hook is registered: its gradients
    equal the non-checkpointed run and the checkpointed enable_vsa run. Without the hook the recompute, which runs
    after the layout context exited, stops in one line naming the hook."""
    torch_kernels = {"backend": "torch"}  # the reference kernels: the point here is the layout, not the kernels
    checkpointed = _vsa_grads("set_attn_processor", checkpointing=True, **torch_kernels)
    plain = _vsa_grads("set_attn_processor", checkpointing=False, **torch_kernels)
    via_enable_vsa = _vsa_grads("enable_vsa", checkpointing=True, **torch_kernels)
    assert plain.keys() == checkpointed.keys() == via_enable_vsa.keys() and plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(checkpointed[name], via_enable_vsa[name], rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(RuntimeError, match=r"runs during backward without a published plan .*install_call_plan_hook"):
        _vsa_grads("set_attn_processor", checkpointing=True, hook=False, **torch_kernels)


def test_a_reentrant_checkpoint_function_recomputes_under_the_plan_of_its_call():
    """Whatever checkpoint function the model was given: torch's reentrant checkpoint recomputes a block inside its own
    backward, and it runs under the call's plan as diffusers' default (non-reentrant) does."""
    def reentrant(module, *args):
        return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=True)

    torch_kernels = {"backend": "torch"}
    plain = _vsa_grads("enable_vsa", checkpointing=False, **torch_kernels)
    checkpointed = _vsa_grads("enable_vsa", checkpointing=True, checkpoint_func=reentrant, **torch_kernels)
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoint_functions_that_call_forward_and_two_calls_before_one_backward():
    """A checkpoint function that calls ``module.forward`` recomputes under the plan too, and two checkpointed calls
    before one backward each recompute under their own call's plan: the gradients equal the plain model's."""
    from diffusers_h3.attention_processors.call_plan import PlanReenteringCheckpoint

    def via_forward(module, *args):
        return torch.utils.checkpoint.checkpoint(module.forward, *args, use_reentrant=False)

    def grads(checkpoint_func):
        torch.manual_seed(0)
        m = MiniMaxH3Transformer3DModel(**TINY).to(DEVICE).train()
        if checkpoint_func is not False:
            m.enable_gradient_checkpointing(checkpoint_func)
        enable_vsa(m, sparsity=0.5, backend="torch")
        loss = 0
        for seed in (3, 4):
            with use_packed_layout(_layout()):
                video, audio = m(**_inputs(seed=seed))
            loss = loss + video.square().mean() + audio.square().mean()
        if checkpoint_func is not False:
            wrapped = m._gradient_checkpointing_func
            assert isinstance(wrapped, PlanReenteringCheckpoint)  # wrapped once, kept for later calls
            assert wrapped.checkpoint is not None and not isinstance(wrapped.checkpoint, PlanReenteringCheckpoint)
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = grads(False)
    for checkpoint_func in (via_forward, None):
        checkpointed = grads(checkpoint_func)
        assert plain.keys() == checkpointed.keys() and plain
        for name in plain:
            torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_removing_the_call_plan_hook_gives_the_model_its_checkpoint_function_back():
    from diffusers_h3.attention_processors.call_plan import PlanReenteringCheckpoint, remove_call_plan_hook

    m = MiniMaxH3Transformer3DModel(**TINY).to(DEVICE).train()
    m.enable_gradient_checkpointing()
    original = m._gradient_checkpointing_func
    enable_vsa(m, sparsity=0.5, backend="torch")
    with use_packed_layout(_layout()):
        m(**_inputs(seed=3))
    assert isinstance(m._gradient_checkpointing_func, PlanReenteringCheckpoint)
    assert m._gradient_checkpointing_func.checkpoint is original
    remove_call_plan_hook(m)
    assert m._gradient_checkpointing_func is original


def test_checkpointed_calls_in_two_threads_recompute_under_their_own_plans():
    """Two threads train one checkpointed model at once, each under its own published layout: each recompute runs
    under its own call's plan, and the accumulated gradients equal two calls made one after the other."""
    import threading

    def run(m, seed, errors):
        try:
            with use_packed_layout(_layout()):
                video, audio = m(**_inputs(seed=seed))
            (video.square().mean() + audio.square().mean()).backward()
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    def model():
        torch.manual_seed(0)
        m = MiniMaxH3Transformer3DModel(**TINY).to(DEVICE).train()
        m.enable_gradient_checkpointing()
        enable_vsa(m, sparsity=0.5, backend="torch")
        return m

    sequential, errors = model(), []
    for seed in (3, 4):
        run(sequential, seed, errors)
    threaded = model()
    threads = [threading.Thread(target=run, args=(threaded, seed, errors)) for seed in (3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for (name, a), (_, b) in zip(sequential.named_parameters(), threaded.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
