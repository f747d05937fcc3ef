"""Decisions of the placement recipes that must not flip: on a multi-node job each rank uses `cuda:<LOCAL_RANK>` (its
GPU on its own node), not `cuda:<global rank>`; the 80 GB recipe gives the ref2va partition the DiT's format, not the
text encoder's. CUDA and the process group are faked."""

import types

import pytest
import torch

from diffusers_h3.parallel import context_parallel
from diffusers_h3.parallel.placement import place_for_context_parallel, single_gpu_resident_kwargs
from diffusers_h3.quantizers import FP8Config, W8A16Config


class _RecordsMoves(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.moves = []

    def to(self, device):
        self.moves.append(torch.device(device))
        return self


@pytest.mark.parametrize("global_rank, local_rank", [(5, 1), (0, 0)])
def test_context_parallel_rank_takes_the_gpu_of_its_local_rank(monkeypatch, global_rank, local_rank):
    # Second node of two with 4 GPUs each: global rank 5 is local rank 1 there.
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", str(global_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(context_parallel, "_ensure_process_group", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: global_rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pipe = types.SimpleNamespace(components={"transformer": _RecordsMoves(), "vae": _RecordsMoves(),
                                             "text_encoder": _RecordsMoves(), "scheduler": object()})  # fmt: skip

    placements = place_for_context_parallel(pipe)

    expected = torch.device(f"cuda:{local_rank}")
    assert pipe.components["transformer"].moves == pipe.components["vae"].moves == [expected]
    assert placements["transformer"] == placements["vae"] == str(expected)
    text_encoder_device = expected if global_rank == 0 else torch.device("cpu")  # only rank 0 encodes the prompt
    assert pipe.components["text_encoder"].moves == [text_encoder_device]


@pytest.mark.parametrize("dit, text_encoder", [("fp8", "w8a16"), ("w8a16", "fp8")])
def test_80gb_recipe_gives_the_ref2va_partition_the_dit_format(dit, text_encoder):
    configs = {"fp8": FP8Config, "w8a16": W8A16Config}
    mapping = single_gpu_resident_kwargs(transformer=dit, text_encoder=text_encoder)["quantization_config"].quant_mapping
    assert type(mapping["transformer"]) is configs[dit]
    assert type(mapping["transformer_ref"]) is configs[dit]
    assert type(mapping["text_encoder"]) is configs[text_encoder]
