"""`enable_tensor_parallel` on 2 and 4 gloo ranks: the tiny DiT (4 heads) equals the one-process DiT for dense,
quantized and LoRA layers and under V100 mode (applied before or after the split); the reduction is bitwise
reproducible and identical on every rank; bad setups give one clear error. One spawn per world size (each spawn pays
a torch import per rank)."""

import pytest
import torch
from diffusers import ContextParallelConfig

from diffusers_h3.testing.tiny import TINY_NUM_FRAMES

from ._ranks import launch
from ._tiny_cp import cp_inputs, cp_transformer, forward


def _quantized(config_name, **kwargs):
    def build(model):
        from diffusers_h3 import quantizers

        return quantizers.quantize(model, getattr(quantizers, config_name)(**kwargs))

    return build


def _with_lora(model, seed=3):
    from peft import LoraConfig

    targets = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "adaln_proj.linear", "proj_out"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config)
    return model


# Block 0's FFN sees activations ~1e4 (its SwiGLU product ~1e7) and the inputs leave fp16's range after projection:
# a plain fp16 model overflows, so V100 mode's per-row power-of-two scaling is exercised on the row-parallel shards.
V100_HOT_NORM = 1e4
V100_INPUT_SCALES = {"hidden_states": 3e4, "encoder_hidden_states": 1e5}


def _hot(model):
    with torch.no_grad():
        model.transformer_blocks[0].norm2.weight.mul_(V100_HOT_NORM)
    return model


def _v100_mode(model):
    from diffusers_h3.hooks.v100_mode import enable_v100_mode

    enable_v100_mode(model)  # FA-V100 attention: its SDPA fallback on CPU
    return model


def _v100_facts(model):
    """What shows that V100 mode is on the model: fp16 GEMM weights, its hooks, the FA-V100 processor's last path."""
    from diffusers_h3.hooks.v100_mode import v100_mode_of

    mode = v100_mode_of(model)
    return {
        "to_q_dtype": model.transformer_blocks[0].attn.to_q.weight.dtype,
        "down_dtype": model.transformer_blocks[0].ff.net[2].weight.dtype,
        "hooked_linears": len(mode.hooked_linears),
        "path": model.transformer_blocks[0].attn.processor.describe_path(),
    }


# name -> (build from the fp32 tiny model, tolerance against the one-process output)
VARIANTS = {
    "fp32": (lambda m: m, 1e-5),
    "w8a16": (_quantized("W8A16Config", compute_dtype=torch.float32), 1e-5),
    "w8a16_group16": (_quantized("W8A16Config", group_size=16, compute_dtype=torch.float32), 1e-5),
    "fp8": (_quantized("FP8Config", compute_dtype=torch.float32), 1e-5),
    "nvfp4": (_quantized("NVFP4Config", compute_dtype=torch.float32), 1e-5),
    "lora": (_with_lora, 1e-5),
    "lora_w8a16": (lambda m: _with_lora(_quantized("W8A16Config", compute_dtype=torch.float32)(m)), 1e-5),
    # fp16 (the V100 dtype) and bf16 round differently once the sum is split: compared loosely, but bitwise across
    # ranks and runs like every variant.
    "fp16_reduce_fp32": (lambda m: m.half(), 2e-2),
    "bf16": (lambda m: m.to(torch.bfloat16), 6e-2),
    # V100 mode rounds only the GEMM operands and outputs to fp16 (residual stream, norms, softmax and the reduction
    # stay fp32), a subset of the roundings of "fp16_reduce_fp32", so that variant's bound holds here too; the split
    # only changes which fp16 partials are rounded before the fp32 sum. Compared with one process in V100 mode.
    "v100_mode": (lambda m: _v100_mode(_hot(m)), 2e-2),
    "tp_then_v100_mode": (lambda m: _v100_mode(_hot(m)), 2e-2),  # the same, applied after enable_tensor_parallel
}
REDUCE_DTYPE = {"fp16_reduce_fp32": torch.float32}
INPUT_DTYPE = {"fp16_reduce_fp32": torch.float16, "bf16": torch.bfloat16}
BUILT_AFTER_TENSOR_PARALLEL = {"tp_then_v100_mode"}
V100_VARIANTS = ("v100_mode", "tp_then_v100_mode")


def _variant_model(variant):
    return VARIANTS[variant][0](cp_transformer())


def _tensor_parallel_model(variant, world_size):
    from diffusers_h3.parallel import enable_tensor_parallel

    build = VARIANTS[variant][0]
    if variant in BUILT_AFTER_TENSOR_PARALLEL:
        return build(enable_tensor_parallel(cp_transformer(), world_size, reduce_dtype=REDUCE_DTYPE.get(variant)))
    return enable_tensor_parallel(build(cp_transformer()), world_size, reduce_dtype=REDUCE_DTYPE.get(variant))


def _inputs(variant):
    inputs = cp_inputs(5, batch=2)
    if variant in V100_VARIANTS:
        inputs = {**inputs, **{k: inputs[k] * scale for k, scale in V100_INPUT_SCALES.items()}}
    dtype = INPUT_DTYPE.get(variant)
    if dtype is not None:
        inputs = {k: v.to(dtype) if v.is_floating_point() and k != "timestep" else v for k, v in inputs.items()}
    return inputs


def _error_of(fn):
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _variants_for(world_size):
    if world_size == 2:
        return [v for v in VARIANTS if v != "w8a16_group16"]
    return ["fp32", "w8a16_group16", "fp8", "nvfp4", "lora_w8a16"]


def _rank_errors(world_size):
    from diffusers_h3.parallel import enable_context_parallel, enable_tensor_parallel

    errors = {
        "bad_heads": _error_of(lambda: enable_tensor_parallel(cp_transformer(num_attention_heads=3), world_size)),
        "world_mismatch": _error_of(lambda: enable_tensor_parallel(cp_transformer(), 2 * world_size)),
        "degree_one": _error_of(lambda: enable_tensor_parallel(cp_transformer(), 1)),
        "w4a4_row_split": _error_of(
            lambda: enable_tensor_parallel(_quantized("NVFP4Config", activation="nvfp4")(cp_transformer()), world_size)
        ),
        "cp_then_tp": _error_of(
            lambda: enable_tensor_parallel(
                enable_context_parallel(cp_transformer(), ContextParallelConfig(ulysses_degree=world_size)), world_size
            )
        ),
    }
    model = enable_tensor_parallel(cp_transformer(), world_size)
    enable_context_parallel(model, ContextParallelConfig(ulysses_degree=world_size))
    errors["tp_then_cp"] = _error_of(lambda: forward(model, cp_inputs(5)))
    model = enable_tensor_parallel(cp_transformer(), world_size)
    errors["lora_after_tp"] = _error_of(lambda: _with_lora(model))
    if world_size == 4:  # a 16-wide shard of the FFN down projection would split groups of 32
        errors["group_straddles"] = _error_of(
            lambda: enable_tensor_parallel(_quantized("W8A16Config", group_size=32)(cp_transformer()), world_size)
        )
    return errors


def _rank_light4_pipeline(lora_path, call):
    from diffusers_h3.parallel import enable_tensor_parallel
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    report = pipe.load_lora_weights(lora_path, "turbo")
    enable_tensor_parallel(pipe, 2)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    out = pipe(**call, generator=torch.Generator().manual_seed(0))
    return {"frames": out.frames, "audio": out.audio, "steps": len(calls), "preset": report.preset.name}


def _rank_loader(folder, world_size):
    import torch.distributed as dist

    from diffusers_h3 import describe
    from diffusers_h3.parallel import load_transformer_tensor_parallel, tensor_parallel_state

    model = load_transformer_tensor_parallel(folder, world_size, dist.get_rank())
    return {
        "out": forward(model, cp_inputs(5)),
        "state": dict(tensor_parallel_state(model)),
        "described": "tensor parallel" in describe(model)["model"],
        "to_q_shape": tuple(model.transformer_blocks[0].attn.to_q.weight.shape),
    }


def _rank_tensor_parallel(world_size, extras):
    import torch.distributed as dist

    from diffusers_h3.parallel import tensor_parallel_state

    results = {"rank": dist.get_rank()}
    for variant in _variants_for(world_size):
        try:
            model = _tensor_parallel_model(variant, world_size)
            inputs = _inputs(variant)
            results[variant] = {
                "runs": [forward(model, inputs), forward(model, inputs)],
                "heads": model.transformer_blocks[0].attn.heads,
                "refiner_heads": model.token_refiner.refiner_blocks[0].attn.heads,
                "state": dict(tensor_parallel_state(model)),
            }
            if variant in V100_VARIANTS:
                results[variant]["v100"] = _v100_facts(model)
        except Exception as error:  # reported per variant by the parent
            results[variant] = f"{type(error).__name__}: {error}"
    results["errors"] = _rank_errors(world_size)
    if "light4" in extras:
        results["light4"] = _rank_light4_pipeline(*extras["light4"])
    if "loader" in extras:
        results["loader"] = _rank_loader(extras["loader"], world_size)
    return results


LIGHT4_CALL = {"prompt": "a fox in the snow", "height": 32, "width": 64, "num_frames": TINY_NUM_FRAMES, "output_type": "latent"}


def _light4_file(tmp_path):
    from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

    from ..loaders._lora_helpers import canonical_lora, save_lora, tiny_transformer, write_layout

    reference = tiny_transformer(**{k: TINY_TRANSFORMER_CONFIG[k] for k in ("num_attention_heads",)})
    lora = canonical_lora(reference, seed=51)
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors"
    return str(save_lora(path, write_layout(lora, "peft_dump"), {"alpha": "4"}))


def _assert_bitwise(a, b, what):
    for x, y in zip(a, b):
        assert torch.equal(x, y), what


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_one_process(world_size, tmp_path):
    extras = {}
    if world_size == 2:
        extras["light4"] = (_light4_file(tmp_path), LIGHT4_CALL)
        cp_transformer().save_pretrained(tmp_path / "tiny_transformer")
        extras["loader"] = str(tmp_path / "tiny_transformer")
    rank_results = launch(_rank_tensor_parallel, world_size, args=(world_size, extras), timeout_s=300)

    for variant in _variants_for(world_size):
        expected = forward(_variant_model(variant), _inputs(variant))
        tolerance = VARIANTS[variant][1]
        first = rank_results[0][variant]
        for results in rank_results:
            outcome = results[variant]
            assert not isinstance(outcome, str), f"{variant} failed on rank {results['rank']}: {outcome}"
            assert outcome["heads"] == outcome["refiner_heads"] == 4 // world_size
            # Deterministic: run to run and rank to rank, bitwise.
            _assert_bitwise(outcome["runs"][0], outcome["runs"][1], f"{variant}: two runs differ")
            _assert_bitwise(outcome["runs"][0], first["runs"][0], f"{variant}: ranks differ")
            for got, want in zip(outcome["runs"][0], expected):
                torch.testing.assert_close(
                    got.float(), want.float(), atol=tolerance, rtol=0, msg=lambda m: f"{variant}: {m}"
                )
        if variant == "fp32":
            state = first["state"]
            replicated, split = state["replicated_bytes"], state["split_bytes_per_rank"]
            assert state["parameter_bytes_per_rank"] == replicated + split
            assert state["unsplit_model_bytes"] == replicated + world_size * split  # dense: exactly 1/N of the split

    if world_size == 2:
        # The inputs overflow a plain fp16 model, so a rank without V100 mode's scaling would not be finite.
        half_inputs = {k: v.half() if v.is_floating_point() and k != "timestep" else v
                       for k, v in _inputs("v100_mode").items()}  # fmt: skip
        plain_half = forward(_hot(cp_transformer()).half(), half_inputs)
        assert not all(torch.isfinite(out).all() for out in plain_half)
        one_process = _v100_facts(_variant_model("v100_mode"))
        for results in rank_results:
            # The order does not matter: same fp16 weight slices, same hooks (the split layers carry no bias).
            _assert_bitwise(results["v100_mode"]["runs"][0], results["tp_then_v100_mode"]["runs"][0], "V100 orders")
            for variant in V100_VARIANTS:
                facts = results[variant]["v100"]
                assert facts["to_q_dtype"] == facts["down_dtype"] == torch.float16, (variant, facts)
                assert facts["hooked_linears"] == one_process["hooked_linears"], (variant, facts)
                # The FA-V100 processor ran (its CPU path: SDPA), not diffusers' processor.
                assert facts["path"].startswith("fallback: torch SDPA on CPU"), (variant, facts)

    for results in rank_results:
        errors = results["errors"]
        assert "does not divide the head count (3)" in errors["bad_heads"]
        assert "must equal the world size" in errors["world_mismatch"]
        assert "tp_degree must be an integer >= 2" in errors["degree_one"]
        assert "activation='nvfp4'" in errors["w4a4_row_split"]
        assert "not supported yet" in errors["cp_then_tp"] and "not supported yet" in errors["tp_then_cp"]
        assert "load LoRA adapters before enable_tensor_parallel" in errors["lora_after_tp"]
        if world_size == 4:
            assert "would split a weight_scale group of 32" in errors["group_straddles"]

    if world_size == 2:
        from diffusers_h3.testing.tiny import tiny_pipeline

        pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
        pipe.load_lora_weights(extras["light4"][0], "turbo")
        expected = pipe(**LIGHT4_CALL, generator=torch.Generator().manual_seed(0))
        reference = cp_transformer()
        expected_loaded = forward(reference, cp_inputs(5))
        for results in rank_results:
            light4 = results["light4"]
            assert light4["preset"] == "lightx2v-fl2v-turbo-4step-768p" and light4["steps"] == 4
            # Four denoising steps compound the per-forward 1e-5 (the split sums round differently): 1e-4 here.
            torch.testing.assert_close(light4["frames"], expected.frames, atol=1e-4, rtol=0)
            torch.testing.assert_close(light4["audio"], expected.audio, atol=1e-4, rtol=0)
            loaded = results["loader"]
            for got, want in zip(loaded["out"], expected_loaded):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert loaded["described"]
            assert loaded["to_q_shape"] == (64, 32)  # 2 of the 4 heads, 32 wide, read as a slice
            state = loaded["state"]
            assert state["parameter_bytes_per_rank"] < state["unsplit_model_bytes"]
            assert state["parameter_bytes_per_rank"] == state["replicated_bytes"] + state["split_bytes_per_rank"]
