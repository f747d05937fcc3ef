"""The ``fast`` / ``fastest`` presets' blocks compile to one graph each (no graph break): every kernel is a custom op
(diffusers_h3/kernels/_triton_utils.py: kernel_op), and the VSA route of a call is prepared outside the blocks."""

import math
import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout  # noqa: E402
from diffusers_h3.pipelines.speed_presets import SpeedPresetConfig, enable_speed_preset_on_transformer  # noqa: E402
from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs  # noqa: E402


TEXT, AUDIO, GRID = 5, 4, (4, 4, 8)  # two 4x4x4 video tiles: the fastest preset's VSA runs sparse


def _layout(step=None):
    video = math.prod(GRID)
    segments = (
        LayoutSegment("text", "prompt", 0, TEXT),
        LayoutSegment("audio", "target", TEXT, TEXT + AUDIO),
        LayoutSegment("video", "target", TEXT + AUDIO, TEXT + AUDIO + video, grid=GRID),
    )
    # as the pipeline publishes it: each step with its own sigma intervals
    sigmas = ((1.0, 0.5), (0.5, 0.0))[step or 0]
    return PackedLayout(segments, seq_len=TEXT + AUDIO + video, step_index=step, num_steps=2, sigma_interval=sigmas,
                        audio_sigma_interval=sigmas)  # fmt: skip


def _run(model, step=None):
    inputs = tiny_transformer_inputs(seed=1, seq_text=TEXT, seq_audio=AUDIO, grid=GRID)
    dtype = next(model.parameters()).dtype
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad(), use_packed_layout(_layout(step)):
        return model(**inputs, return_dict=False)


class _GraphRecorder:
    """A dynamo backend that keeps every graph it is given and the ATen graph AOTAutograd makes of it (where a
    quantized weight's ``F.linear`` becomes its GEMM op), and runs that eagerly."""

    def __init__(self):
        self.graphs = []
        self.aten_graphs = []

    def __call__(self, gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        self.graphs.append(gm)

        def keep(aten_gm, _inputs):
            self.aten_graphs.append(aten_gm)
            return aten_gm.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    def ops(self):
        graphs = self.graphs + self.aten_graphs
        return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


def compile_blocks_and_rerun(model, before_compile=None):
    """The eager output, then ``compile_repeated_blocks(fullgraph=True)`` (any graph break raises) with a recording
    backend, its output, and the next denoising step's (any recompilation raises): ``(eager, compiled, again,
    recorder)``."""
    import torch._dynamo

    eager = _run(model)
    torch._dynamo.reset()
    if before_compile is not None:
        before_compile()
    recorder = _GraphRecorder()
    model.compile_repeated_blocks(fullgraph=True, backend=recorder)
    compiled = _run(model)
    with torch._dynamo.config.patch(error_on_recompile=True):  # raises on a recompilation
        again = _run(model, step=1)  # another denoising step's layout: same graphs, no recompilation
    return eager, compiled, again, recorder


# Whether the attention kernels run on these CPU tensors: under the Triton interpreter (a CPU host). On a CUDA host
# triton compiles the kernels for the GPU, so CPU tensors take the torch references, traced inline (no custom op):
# the blocks must still compile to one graph each, but the attention ops are not in it.
KERNELS_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
# The custom ops each preset's blocks must call on this CPU (W8A16 GEMMs: no FP8 tensor cores here).
PRESET_OPS = {
    "exact": set(),  # diffusers' processor and bf16 weights: no kernel of ours on a CPU
    "fast": {"diffusers_h3.w8a16_linear.default"} | ({"diffusers_h3.fp8_attention.default"} if KERNELS_ON_CPU else set()),
    "fastest": {"diffusers_h3.w8a16_linear.default", "diffusers_h3.vsa_attention.default"},
}


@pytest.mark.triton_interpreter  # the kernels' custom ops, as CUDA runs them
@pytest.mark.parametrize("preset", ["exact", "fast", "fastest"])
def test_preset_blocks_compile_fullgraph_around_the_kernel_ops(preset):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = tiny_transformer()
    enable_speed_preset_on_transformer(model, SpeedPresetConfig(preset, compile=False))
    # fullgraph=True: any graph break inside a block (an op put back behind torch.compiler.disable, a Python-level
    # decision dynamo cannot trace) raises here.
    eager, compiled, again, recorder = compile_blocks_and_rerun(model, before_compile=counters.clear)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert recorder.graphs and len(recorder.graphs) == counters["stats"]["unique_graphs"]
    assert PRESET_OPS[preset] <= recorder.ops(), sorted(op for op in recorder.ops() if "diffusers_h3" in op)
    for got, ref in zip(compiled, eager):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(again, eager):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    blocks = model.transformer_blocks
    if preset != "exact":
        assert "not run yet" not in blocks[0].attn.processor.describe_path()
    torch._dynamo.reset()


def test_presets_pass_fullgraph_to_compile_repeated_blocks():
    from diffusers_h3.pipelines.speed_presets import compile_blocks

    calls = []

    class Blocks:
        def compile_repeated_blocks(self, **options):
            calls.append(options)

    assert "fullgraph=True" in compile_blocks(Blocks(), "fast", fullgraph=True)
    assert "fullgraph=False" in compile_blocks(Blocks(), "exact")
    emulate = {"emulate_precision_casts": True}
    assert calls == [{"fullgraph": True, "options": emulate}, {"fullgraph": False, "options": emulate}]


@pytest.mark.parametrize(
    "make, op",
    [
        ("flashinfer_bf16", "diffusers_h3.flashinfer_dense_attention.default"),
        ("flashinfer_fp8", "diffusers_h3.flashinfer_fp8_attention.default"),
        ("fp4", "diffusers_h3.block_sparse_attention.default"),
    ],
)
@pytest.mark.triton_interpreter
def test_other_processors_compile_fullgraph(make, op, flashinfer_stand_in):
    """The FlashInfer processor (through the CPU stand-in of the library) and the emulated FP4 attention (P emulated
    in the Triton kernel) also trace as one graph per block."""
    import torch._dynamo

    from diffusers_h3.attention_processors.flashinfer import MiniMaxH3FlashInferProcessor
    from diffusers_h3.attention_processors.low_precision import MiniMaxH3LowPrecisionAttnProcessor

    torch.manual_seed(0)
    model = tiny_transformer()
    if make.startswith("flashinfer"):
        model = model.to(torch.bfloat16)  # FlashInfer takes 16-bit Q/K/V
        processor = MiniMaxH3FlashInferProcessor(precision=make.split("_")[1])
    else:
        processor = MiniMaxH3LowPrecisionAttnProcessor("fp4")
    for block in model.transformer_blocks:
        block.attn.set_processor(processor)
    eager, compiled, again, recorder = compile_blocks_and_rerun(model)
    assert op in recorder.ops() or not (KERNELS_ON_CPU or make.startswith("flashinfer")), sorted(recorder.ops())
    for got, ref in zip(compiled + again, eager + eager):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
