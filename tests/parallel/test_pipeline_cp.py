"""The tiny `MiniMaxH3Pipeline` under context parallelism on 2 gloo ranks equals the one-process pipeline."""

import pytest
import torch
from diffusers import ContextParallelConfig

from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline

from ._ranks import launch


# 124 frames: several VAE temporal chunks, so that the parallel decode has tiles to split over the ranks.
RUN = {"prompt": "a drum", "height": 32, "width": 32, "num_frames": 124, "num_inference_steps": 3, "output_type": "pt"}
# Where only the placement is under test, the short tiny clip.
SHORT_RUN = {**RUN, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2}


def _counting(module, calls, name):
    module.register_forward_pre_hook(lambda *args: calls.__setitem__(name, calls.get(name, 0) + 1))


def _rank_pipeline():
    import torch.distributed as dist

    from diffusers_h3.parallel import enable_context_parallel

    pipe = tiny_pipeline(seed=2)
    enable_context_parallel(pipe, ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    calls = {}
    _counting(pipe._language_layers()[0], calls, "text_encoder")  # the encoder exits early: count its first layer
    _counting(pipe.transformer.context_embedder, calls, "context_embedder")
    _counting(pipe.transformer.token_refiner.refiner_blocks[0], calls, "refiner")
    _counting(pipe.vae.decoder, calls, "vae_decoder")
    out = pipe(**RUN, generator=torch.Generator().manual_seed(0))
    result = {"frames": out.frames, "audio": out.audio, "calls": calls}
    try:  # a rank seeded differently: every rank gets the error, none hangs
        pipe(**RUN, generator=torch.Generator().manual_seed(dist.get_rank()))
        result["seed_mismatch"] = None
    except ValueError as error:
        result["seed_mismatch"] = str(error)
    # The prompt is encoded on rank 0 only: its failure reaches every rank instead of leaving them in a broadcast.
    if dist.get_rank() == 0:
        pipe.encode_prompt = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("encoder out of memory"))
    try:
        pipe(**RUN, generator=torch.Generator().manual_seed(0))
        result["encode_failure"] = None
    except RuntimeError as error:
        result["encode_failure"] = str(error)
    return result


def test_pipeline_under_context_parallel_matches_one_process():
    rank_results = launch(_rank_pipeline, 2, timeout_s=400)
    pipe = tiny_pipeline(seed=2)
    calls = {}
    _counting(pipe.vae.decoder, calls, "vae_decoder")
    expected = pipe(**RUN, generator=torch.Generator().manual_seed(0))
    for rank, result in enumerate(rank_results):
        torch.testing.assert_close(result["frames"], expected.frames, atol=1e-5, rtol=0)
        torch.testing.assert_close(result["audio"], expected.audio, atol=1e-5, rtol=0)
        assert "generators differ across ranks" in result["seed_mismatch"]
        assert "encoder out of memory" in result["encode_failure"]
        steps = RUN["num_inference_steps"] - 1
        # The text encoder runs on rank 0 only; the refiner once per request although the DiT runs every step.
        assert result["calls"].get("text_encoder", 0) == (1 if rank == 0 else 0)
        assert result["calls"]["context_embedder"] == steps
        assert result["calls"]["refiner"] == 1
    # The VAE tile decodes are split over the ranks.
    assert sum(r["calls"]["vae_decoder"] for r in rank_results) == calls["vae_decoder"]
    assert all(r["calls"]["vae_decoder"] < calls["vae_decoder"] for r in rank_results)


def _rank_placed_pipeline(text_encoder):
    import torch.distributed as dist

    from diffusers_h3.parallel import enable_context_parallel, place_for_context_parallel

    pipe = tiny_pipeline(seed=2)
    placements = place_for_context_parallel(pipe, "cpu", text_encoder=text_encoder)
    enable_context_parallel(pipe, ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    out = pipe(**SHORT_RUN, generator=torch.Generator().manual_seed(0))
    hooked = getattr(pipe.text_encoder, "_diffusers_hook", None) is not None
    return {"frames": out.frames, "audio": out.audio, "placements": placements, "text_encoder_hooked": hooked}


def test_context_parallel_placement_keeps_the_text_encoder_on_rank_0_only():
    from diffusers_h3.parallel import place_for_context_parallel

    with pytest.raises(ValueError, match="text_encoder must be one of"):
        place_for_context_parallel(tiny_pipeline(seed=2), "cpu", text_encoder="sharded")
    expected = tiny_pipeline(seed=2)(**SHORT_RUN, generator=torch.Generator().manual_seed(0))
    for results in (launch(_rank_placed_pipeline, 2, args=("offload",), timeout_s=400),
                    launch(_rank_placed_pipeline, 2, args=("resident",), timeout_s=400)):  # fmt: skip
        for rank, result in enumerate(results):
            torch.testing.assert_close(result["frames"], expected.frames, atol=1e-5, rtol=0)
            torch.testing.assert_close(result["audio"], expected.audio, atol=1e-5, rtol=0)
            assert result["placements"]["transformer"] == "cpu"
        rank0, rank1 = results[0]["placements"]["text_encoder"], results[1]["placements"]["text_encoder"]
        assert rank1.startswith("cpu (rank 0 encodes") and not results[1]["text_encoder_hooked"]
        assert rank0.startswith("group offload (leaf level") == results[0]["text_encoder_hooked"]
    assert results[0]["placements"]["text_encoder"] == "cpu"  # the last launch: "resident" on rank 0's device


@pytest.mark.slow
def test_pipeline_end_to_end_under_context_parallel_writes_the_mp4_on_rank_0(tmp_path):
    """The CPU variant of tests/gpu/test_parallel_one_gpu.py's end-to-end case (same rank function)."""
    import av

    from tests.gpu._parallel_cases import PIPELINE_RUN, pipeline_reference, rank_pipeline_to_mp4, rel_l2

    frames, audio = pipeline_reference("cpu")
    rank_results = launch(rank_pipeline_to_mp4, 2, args=(str(tmp_path), "cpu"), timeout_s=400)
    for rank, result in enumerate(rank_results):
        assert rel_l2(result["frames"], frames) <= 1e-5, rank
        assert rel_l2(result["audio"], audio) <= 1e-5, rank
    assert rank_results[0]["written"] == str(tmp_path / "clip.mp4") and rank_results[1]["written"] is None
    with av.open(rank_results[0]["written"]) as container:
        assert sum(1 for _ in container.decode(video=0)) == PIPELINE_RUN["num_frames"]
