"""The tiny MiniMax-H3 pipeline end to end with video sparse attention installed through ``pipe.enable_vsa``."""

import logging
import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.attention_processors.vsa import MiniMaxH3VSAProcessor, vsa_state  # noqa: E402
from diffusers_h3.testing.tiny import tiny_pipeline  # noqa: E402


CALL = {"prompt": "a cat", "height": 64, "width": 64, "num_frames": 22, "num_inference_steps": 3, "output_type": "latent"}


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=3)


def _run(pipe):
    return pipe(**CALL, generator=torch.Generator().manual_seed(0))


def test_pipeline_runs_with_vsa(pipe):
    ref = _run(pipe)
    assert pipe.enable_vsa(sparsity=0.0) is pipe
    assert all(isinstance(b.attn.processor, MiniMaxH3VSAProcessor) for b in pipe.transformer.transformer_blocks)
    # The token refiner keeps its dense processor.
    assert not isinstance(pipe.transformer.token_refiner.refiner_blocks[0].attn.processor, MiniMaxH3VSAProcessor)
    assert vsa_state(pipe.transformer)["blocks"] == len(pipe.transformer.transformer_blocks)
    dense = _run(pipe)
    assert torch.equal(dense.frames, ref.frames) and torch.equal(dense.audio, ref.audio)

    pipe.enable_vsa(sparsity=0.75, dense_first_steps=1)
    sparse = _run(pipe)
    assert torch.isfinite(sparse.frames).all() and torch.isfinite(sparse.audio).all()
    assert not torch.equal(sparse.frames, ref.frames)
    rel = ((sparse.frames - ref.frames).norm() / ref.frames.norm()).item()
    assert rel < 0.5
    pipe.enable_vsa(sparsity=0.75, dense_first_steps=10)  # every step dense -> exactly the dense result
    assert torch.equal(_run(pipe).frames, ref.frames)
    from diffusers_h3.attention_processors.vsa import disable_vsa

    disable_vsa(pipe.transformer)


class _RecompileLog(logging.Handler):
    """Collects torch.compile's recompilation messages while active."""

    def __enter__(self):
        self.messages = []
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(self)  # dynamo's loggers do not propagate to "torch"
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch._dynamo").removeHandler(self)
        torch._logging.set_logs()

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            self.messages.append(message)


def test_regional_torch_compile_with_vsa_and_fp8_layers():
    # diffusers' compile_repeated_blocks(fullgraph=True) around our processors and quantized layers: the kernels are
    # custom ops (one graph node each), the VSA route is prepared before the blocks run, so every block is one graph;
    # the result equals the eager run over several steps.
    import torch._dynamo
    from torch._dynamo.utils import counters

    from diffusers_h3 import FP8Config, quantize

    pipe = tiny_pipeline(seed=3)
    quantize(pipe.transformer, FP8Config())
    pipe.enable_vsa(sparsity=0.75)
    eager = _run(pipe)
    torch._dynamo.reset()
    counters.clear()
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    recompiles = _RecompileLog()
    with recompiles:
        compiled = _run(pipe)
    # One compiled version of our processor serves every block and every denoising step (no specialization on a
    # block's index or on the step's layout); diffusers' own blocks may recompile for their shapes.
    assert not [m for m in recompiles.messages if "diffusers_h3" in m], recompiles.messages
    assert counters["stats"]["unique_graphs"] > 0  # dynamo really compiled the blocks
    assert not counters["graph_break"], dict(counters["graph_break"])  # ... in one piece each
    torch.testing.assert_close(compiled.frames, eager.frames, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.audio, eager.audio, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
