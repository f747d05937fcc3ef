"""Multi-rank runs on ONE GPU: N ranks share it over gloo ("cpu:gloo,cuda:gloo": gloo stages CUDA tensors through the
host), each a fresh process, so the real GPU kernels run under a real process group without a multi-GPU machine.

Compared with one process: every CP and TP case of tests/gpu/test_multi_gpu.py at 2 and 4 ranks (the case tables of
tests/gpu/_parallel_cases.py), the real shape (2 full-width H3 blocks on the 38,222-row t2va layout), the tiny pipeline
end to end under `enable_context_parallel` with rank 0 writing the MP4, `parallel_vae_decode` at 2 and 4 ranks, and a
rank failing inside a forward. What needs one GPU per rank (NCCL, the placement recipe) stays in test_multi_gpu.py.

    python -m pytest -o addopts="" -m gpu tests/gpu/test_parallel_one_gpu.py -q
"""

import av
import pytest
import torch

from diffusers_h3.parallel._launch import launch

from ._parallel_cases import (
    CP_CASES,
    PIPELINE_RUN,
    REAL_SHAPE_CP_CASES,
    REAL_SHAPE_TP_CASES,
    TP_CASES,
    assert_failure_ends_the_job,
    pipeline_reference,
    rank_cp,
    rank_pipeline_to_mp4,
    rank_real_shape,
    rank_tp,
    rank_vae,
    real_shape_reference,
    rel_l2,
)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHARED_GPU = "cpu:gloo,cuda:gloo"


def _rank_cases(device_type):
    return {"cp": rank_cp(device_type), "tp": rank_tp(device_type), "vae": rank_vae(device_type)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_tp_and_vae_cases_on_ranks_sharing_one_gpu(world_size):
    rank_results = launch(_rank_cases, world_size, args=("cuda",), backend=SHARED_GPU, timeout_s=240)
    for rank, results in enumerate(rank_results):
        for case in CP_CASES:
            # Same attention kernels on the full sequence per head; only the GEMMs see other row counts.
            assert results["cp"][case] <= 1e-2, (rank, case, results["cp"][case])
        for case in TP_CASES:
            # bf16 partial sums added in another order than the unsplit GEMM's accumulation (docs/multi_gpu.md)
            assert results["tp"][case] <= 6e-2, (rank, case, results["tp"][case])
        vae = results["vae"]
        # The same tile decodes as the serial tiled decode in the same process: bitwise in fp32.
        assert torch.equal(vae["fp32"]["parallel"], vae["fp32"]["serial"]), rank
        assert rel_l2(vae["bf16"]["parallel"], vae["bf16"]["serial"]) <= 1e-2, rank
    assert all(r["tp"] == rank_results[0]["tp"] for r in rank_results)  # the rank-order reduction is identical
    for results in rank_results[1:]:  # every rank returns the full video
        assert torch.equal(results["vae"]["fp32"]["parallel"], rank_results[0]["vae"]["fp32"]["parallel"])


def test_real_shape_cp2_and_tp2_match_one_process():
    expected = real_shape_reference("cuda")
    rank_results = launch(rank_real_shape, 2, args=("cuda",), backend=SHARED_GPU, timeout_s=300)
    keys = [("cp", c) for c in REAL_SHAPE_CP_CASES] + [("tp", c) for c in REAL_SHAPE_TP_CASES]
    errors = {(rank, key): rel_l2(results[key], expected[key]) for rank, results in enumerate(rank_results)
              for key in keys}  # fmt: skip
    assert all(torch.isfinite(expected[key]).all() for key in keys)
    assert max(errors.values()) <= 1e-2, errors


def test_pipeline_end_to_end_under_context_parallel_writes_the_mp4_on_rank_0(tmp_path):
    frames, audio = pipeline_reference("cuda")
    rank_results = launch(rank_pipeline_to_mp4, 2, args=(str(tmp_path), "cuda"), backend=SHARED_GPU, timeout_s=400)
    for rank, result in enumerate(rank_results):
        assert rel_l2(result["frames"], frames) <= 1e-2, rank
        assert rel_l2(result["audio"], audio) <= 1e-2, rank
    assert rank_results[0]["written"] == str(tmp_path / "clip.mp4") and rank_results[1]["written"] is None
    with av.open(rank_results[0]["written"]) as container:
        assert sum(1 for _ in container.decode(video=0)) == PIPELINE_RUN["num_frames"]


def test_a_rank_failing_inside_a_forward_ends_every_rank_with_one_error():
    assert_failure_ends_the_job("cuda", SHARED_GPU)
