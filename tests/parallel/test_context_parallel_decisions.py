"""Decisions of `enable_context_parallel` that must not flip: processors that run Ulysses only (VSA, low precision,
FA-V100, FlashInfer) are refused under `ring_degree > 1` and accepted under Ulysses; diffusers' processor is accepted
under ring attention only on a backend that returns the log-sum-exp.

No process group: the world size is faked and the run stops at the first collective (the cross-rank setup check),
which `enable_context_parallel` reaches only after every processor passed."""

import pytest
import torch
from diffusers import ContextParallelConfig

from diffusers_h3.parallel import context_parallel

from ._tiny_cp import cp_transformer


class _PassedTheProcessorChecks(Exception):
    pass


@pytest.fixture
def two_ranks(monkeypatch):
    def reached_the_first_collective(description):
        raise _PassedTheProcessorChecks

    monkeypatch.setattr(context_parallel, "_ensure_process_group", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(context_parallel, "_check_same_on_every_rank", reached_the_first_collective)


def _vsa():
    from diffusers_h3.attention_processors import MiniMaxH3VSAProcessor

    return MiniMaxH3VSAProcessor(sparsity=0.5, tile=(2, 2, 4), backend="torch")


def _low_precision():
    from diffusers_h3.attention_processors import MiniMaxH3LowPrecisionAttnProcessor

    return MiniMaxH3LowPrecisionAttnProcessor("int8")


def _fa_v100():
    from diffusers_h3.attention_processors import MiniMaxH3FAV100Processor

    return MiniMaxH3FAV100Processor()


def _flashinfer():
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor

    return MiniMaxH3FlashInferProcessor("fa3")


ULYSSES_ONLY = {"vsa": _vsa, "low_precision": _low_precision, "fa_v100": _fa_v100, "flashinfer": _flashinfer}


def _model_with(processor):
    model = cp_transformer()
    for block in model.transformer_blocks:
        block.attn.set_processor(processor)
    return model


@pytest.mark.parametrize("backend", [None, "flash"])  # flash: a ring-capable backend must not let them through
@pytest.mark.parametrize("kind", sorted(ULYSSES_ONLY))
def test_ulysses_only_processors_are_refused_under_ring_attention(two_ranks, kind, backend):
    processor = ULYSSES_ONLY[kind]()
    processor._attention_backend = backend  # what transformer.set_attention_backend(...) records on it
    with pytest.raises(ValueError, match=rf"ring_degree=2 needs attention that returns a log-sum-exp; "
                                         rf"{type(processor).__name__} .* runs Ulysses only"):
        context_parallel.enable_context_parallel(_model_with(processor), ContextParallelConfig(ring_degree=2))
    # The same processor under Ulysses passes every processor check.
    with pytest.raises(_PassedTheProcessorChecks):
        context_parallel.enable_context_parallel(_model_with(processor), ContextParallelConfig(ulysses_degree=2))


def test_diffusers_processor_runs_ring_attention_only_on_a_log_sum_exp_backend(two_ranks):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    processor = MiniMaxH3AttnProcessor()
    with pytest.raises(ValueError, match="needs an attention backend with log-sum-exp, but .* uses 'native'"):
        context_parallel.enable_context_parallel(_model_with(processor), ContextParallelConfig(ring_degree=2))
    processor._attention_backend = "flash"  # what set_attention_backend("flash") records (no flash-attn needed)
    with pytest.raises(_PassedTheProcessorChecks):
        context_parallel.enable_context_parallel(_model_with(processor), ContextParallelConfig(ring_degree=2))


@pytest.mark.parametrize(
    "gpus, backend_config, backend, on_cpu",
    [
        (0, "cpu:gloo,cuda:gloo", "gloo", True),  # no accelerator: always CPU meshes
        (1, "cpu:gloo", "cpu:gloo", True),  # CPU ranks on a GPU host
        (1, "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", False),  # the product's GPU ranks
        (1, "cuda:nccl", "nccl", False),
        (1, "cpu:gloo,cuda:gloo", "gloo", False),  # ranks sharing one GPU over gloo
    ],
)
def test_context_parallel_meshes_follow_the_process_group_not_only_the_host(monkeypatch, gpus, backend_config,
                                                                             backend, on_cpu):  # fmt: skip
    import torch.distributed as dist

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: backend_config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert context_parallel.parallel_on_cpu() is on_cpu
