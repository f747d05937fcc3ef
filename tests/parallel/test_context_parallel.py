"""`enable_context_parallel` on 2 and 4 gloo ranks: the tiny DiT forward equals the one-process forward."""

import pytest
import torch
from diffusers import ContextParallelConfig

from diffusers_h3 import LowPrecisionAttentionConfig

from ._ranks import launch
from ._tiny_cp import add_random_gates, cp_inputs, cp_transformer, forward, forward_with_layout, vsa_inputs


# (text rows, batch): packed lengths 21 and 24 (uneven and even shards for 2 and 4 ranks).
SHAPES = [(5, 1), (8, 2)]


class _ProcessorWithoutCP:
    """A processor that does not declare `_parallel_config`: it would attend over its own shard only."""

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        return hidden_states


def _error_of(fn):
    try:
        fn()
    except (ValueError, RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _install_vsa(sparsity):
    def install(model):
        from diffusers_h3.attention_processors import enable_vsa

        add_random_gates(model)
        enable_vsa(model, sparsity=sparsity, tile=(2, 2, 4), backend="torch")  # exact references: fast on CPU

    return install


def _install_low_precision(precision):
    def install(model):
        from diffusers_h3.attention_processors import enable_low_precision_attention

        enable_low_precision_attention(model, LowPrecisionAttentionConfig(precision))

    return install


def _install_fa_v100(model):
    from diffusers_h3.attention_processors.fa_v100 import MiniMaxH3FAV100Processor

    # On CPU its core is the SDPA fallback; what is checked is the Ulysses exchange around that core.
    model.set_attn_processor(MiniMaxH3FAV100Processor())


def _install_diffusers_default(model):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    model.set_attn_processor(MiniMaxH3AttnProcessor())  # one instance shared by every module, refiner included


# name -> (installer, installed before or after enable_context_parallel, uses the VSA grid and its layout)
VARIANTS = {
    "diffusers_default": (lambda model: None, "before", False),
    "diffusers_default_installed_after": (_install_diffusers_default, "after", False),
    "vsa_sparsity_0": (_install_vsa(0.0), "after", True),
    "vsa_sparsity_0.8": (_install_vsa(0.8), "after", True),
    "low_precision_fp8": (_install_low_precision("fp8"), "before", True),
    "low_precision_int8": (_install_low_precision("int8"), "after", True),
    "fa_v100": (_install_fa_v100, "before", False),
    "fa_v100_installed_after": (_install_fa_v100, "after", False),
}


def _variant_forward(variant, shape, world_size=None):
    """The variant's forward on a fresh model; with `world_size`, under context parallelism."""
    install, when, uses_layout = VARIANTS[variant]
    model = cp_transformer()
    if when == "before" or world_size is None:
        install(model)
    if world_size is not None:
        from diffusers_h3.parallel import enable_context_parallel

        enable_context_parallel(model, ContextParallelConfig(ulysses_degree=world_size))
        if when == "after":
            install(model)
    if uses_layout:
        inputs, layout = vsa_inputs(seq_text=shape[0])
        outputs = forward_with_layout(model, inputs, layout)
    else:
        outputs = forward(model, cp_inputs(*shape))
    refiner_unconfigured = {
        name: getattr(module.processor, "_parallel_config", None) is None
        for name, module in model.named_modules()
        if name.startswith("token_refiner.") and hasattr(module, "processor")
    }
    return outputs, refiner_unconfigured


def _variant_shapes(variant):
    # (text rows, batch); packed lengths 21 / 24 for the default grid, 99 for the VSA grid (uneven on 2 and 4 ranks).
    return SHAPES if not VARIANTS[variant][2] else [(5, 1)]


def _rank_context_parallel(world_size):
    import torch.distributed as dist

    from diffusers_h3.parallel import enable_context_parallel

    results = {"rank": dist.get_rank()}
    for variant in VARIANTS:
        for shape in _variant_shapes(variant):
            try:
                results[(variant, shape)] = _variant_forward(variant, shape, world_size)
            except Exception as error:  # reported per variant by the parent, with the others' results
                results[(variant, shape)] = f"{type(error).__name__}: {error}"

    config = ContextParallelConfig(ulysses_degree=world_size)
    results["bad_heads"] = _error_of(lambda: enable_context_parallel(cp_transformer(num_attention_heads=3), config))
    results["world_mismatch"] = _error_of(
        lambda: enable_context_parallel(cp_transformer(), ContextParallelConfig(ulysses_degree=2 * world_size))
    )
    results["ring_native"] = _error_of(
        lambda: enable_context_parallel(cp_transformer(), ContextParallelConfig(ulysses_degree=world_size // 2,
                                                                                ring_degree=2))  # fmt: skip
    )
    # Rank 1 loads a different model: every rank gets the same error, none hangs.
    ffn = 64 if dist.get_rank() != 1 else 96
    results["config_mismatch"] = _error_of(
        lambda: enable_context_parallel(cp_transformer(ffn_dim=ffn), ContextParallelConfig(ulysses_degree=world_size))
    )
    model = enable_context_parallel(cp_transformer(), ContextParallelConfig(ulysses_degree=world_size))
    model.transformer_blocks[1].attn.set_processor(_ProcessorWithoutCP())
    results["processor_without_cp"] = _error_of(lambda: forward(model, cp_inputs(5)))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_forward_matches_one_process(world_size):
    rank_results = launch(_rank_context_parallel, world_size, args=(world_size,), timeout_s=400)
    for variant in VARIANTS:
        for shape in _variant_shapes(variant):
            (expected_video, expected_audio), _ = _variant_forward(variant, shape)
            for results in rank_results:
                outcome = results[(variant, shape)]
                assert not isinstance(outcome, str), f"{variant} failed on rank {results['rank']}: {outcome}"
                (video, audio), refiner_unconfigured = outcome
                torch.testing.assert_close(video, expected_video, atol=1e-5, rtol=0, msg=lambda m: f"{variant}: {m}")
                torch.testing.assert_close(audio, expected_audio, atol=1e-5, rtol=0, msg=lambda m: f"{variant}: {m}")
                # The refiner's text rows are not sharded: its attention runs without the config.
                assert refiner_unconfigured and all(refiner_unconfigured.values()), (variant, refiner_unconfigured)

    for results in rank_results:
        assert "head count (3)" in results["bad_heads"] and "ulysses_degree" in results["bad_heads"]
        assert "world size" in results["world_mismatch"]
        assert "native" in results["ring_native"] and "ring_degree" in results["ring_native"]
        assert "differs across ranks" in results["config_mismatch"]
        assert "_ProcessorWithoutCP" in results["processor_without_cp"]


def test_the_accelerate_advice_starts_n_processes_on_a_host_without_gpus(monkeypatch, tmp_path):
    # `accelerate launch --num-processes 2` on a CPU host starts one process: the advice must name a command that
    # reaches Accelerate's multi-process launcher there (no CUDA device visible).
    import re

    import torch.distributed as dist
    from accelerate.commands import launch as accelerate_launch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from diffusers_h3.parallel.context_parallel import _ensure_process_group

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    # Not this machine's `accelerate config` file, if it has one.
    monkeypatch.setattr(accelerate_launch, "default_config_file", str(tmp_path / "no_config.yaml"))
    with pytest.raises(RuntimeError, match="one process per rank") as raised:
        _ensure_process_group()
    command = re.search(r"`(accelerate launch [^`]*)`", str(raised.value)).group(1).replace(" N", " 2")
    args = launch_command_parser().parse_args([*command.split()[2:], "generate.py"])
    args = _validate_launch_command(args)[0]
    assert args.multi_gpu and not args.cpu and args.num_processes == 2, command


def _rank_plain_gloo():
    """A process group created as users do, `init_process_group("gloo")` (the launcher passes "gloo"), on a host
    without GPUs: context parallelism, tensor parallelism and the parallel VAE decode."""
    import torch.distributed as dist

    from diffusers_h3.parallel import enable_context_parallel, enable_tensor_parallel
    from diffusers_h3.parallel.vae import parallel_vae_decode
    from diffusers_h3.testing.tiny import tiny_vae

    assert str(dist.get_backend()) == "gloo"
    world_size = dist.get_world_size()
    model = enable_context_parallel(cp_transformer(), ContextParallelConfig(ulysses_degree=world_size))
    config = model._parallel_config.context_parallel_config
    results = {
        "cp": forward(model, cp_inputs(5)),
        # diffusers' size exchange runs on the CPU only for a backend string naming "cpu"
        "size_exchange_backends": [str(dist.get_backend(m.get_group())) for m in (config._ulysses_mesh,
                                                                                  config._flattened_mesh)],
        "tp": forward(enable_tensor_parallel(cp_transformer(), tp_degree=world_size), cp_inputs(5)),
    }  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = tiny_vae()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_min_overlap_height=16,
                      tile_sample_min_overlap_width=16)  # fmt: skip
    latents = torch.randn(1, 4, 9, 3, 4, generator=torch.Generator().manual_seed(0))
    results["vae"] = parallel_vae_decode(vae, latents)
    with torch.no_grad():
        results["vae_serial"] = vae.decode(latents).sample
    return results


def test_plain_gloo_process_group_runs_every_parallel_path():
    """`init_process_group("gloo")` on a CPU host with a CUDA build of torch used to end the first context-parallel
    forward in "Found no NVIDIA driver" (diffusers' size exchange went to CUDA)."""
    rank_results = launch(_rank_plain_gloo, 2, backend="gloo", timeout_s=300)
    expected_video, expected_audio = forward(cp_transformer(), cp_inputs(5))
    for results in rank_results:
        assert all("cpu" in backend for backend in results["size_exchange_backends"]), results["size_exchange_backends"]
        for got in (results["cp"], results["tp"]):
            torch.testing.assert_close(got[0], expected_video, atol=1e-5, rtol=0)
            torch.testing.assert_close(got[1], expected_audio, atol=1e-5, rtol=0)
        assert torch.equal(results["vae"], results["vae_serial"])


def test_a_rank_failing_inside_a_forward_ends_the_job_with_its_error():
    from tests.gpu._parallel_cases import assert_failure_ends_the_job

    assert_failure_ends_the_job("cpu", "cpu:gloo", launch=launch)
