"""benchmarks/activation_trace.py: the live-tensor counter, the meta trace against a real CPU forward, the committed
trace."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG


ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("activation_trace", ROOT / "benchmarks" / "activation_trace.py")
trace_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_script)

# The tiny DiT with a wide feed-forward (chunking then matters) and the released rope width fitting its heads.
TINY = {**TINY_TRANSFORMER_CONFIG, "ffn_dim": 256}


def test_the_counter_follows_storages_not_tensor_objects():
    counter = trace_script.LiveTensorBytes()
    with counter:
        a = torch.empty(1000, 250, device="meta")  # 1 MB
        view = a.view(-1)
        del a
        assert counter.live == 1_000_000  # the view keeps the storage alive
        b = torch.empty(2000, 250, device="meta")
        assert counter.live == 3_000_000 and counter.peak == 3_000_000
        del view
        assert counter.live == 2_000_000
        c = b * 2
        del b, c
    assert counter.live == 0 and counter.peak == 4_000_000 and "mul" in counter.at_peak


def test_weights_are_not_counted():
    weight = torch.nn.Parameter(torch.empty(1000, 1000, device="meta"))
    counter = trace_script.LiveTensorBytes(excluded=[weight.untyped_storage()])
    with counter:
        transposed = weight.t()  # a view of the weight's storage
        out = torch.empty(10, 1000, device="meta") @ transposed
    assert counter.peak == 2 * 10 * 1000 * 4 and out.shape == (10, 1000)


@pytest.mark.parametrize("chunk", [None, 1024])
def test_the_meta_trace_counts_what_a_real_cpu_forward_creates(chunk):
    """The same forward on real CPU tensors (the weights random) creates exactly the tensors the meta trace counts:
    the meta device stands in for the GPU's tensor lifetimes without computing anything."""
    rows = 2400
    torch.manual_seed(0)
    real = trace_script.build_meta_transformer(TINY, ffn_chunk_rows=chunk, device="cpu")
    meta = trace_script.build_meta_transformer(TINY, ffn_chunk_rows=chunk)
    measured = trace_script.trace_forward_peak(real, trace_script.forward_inputs(rows, TINY, device="cpu"))
    traced = trace_script.trace_forward_peak(meta, trace_script.forward_inputs(rows, TINY))
    assert traced.peak == measured.peak > 0
    assert traced.at_peak == measured.at_peak


def test_the_peak_grows_with_rows_and_chunking_bounds_the_feed_forward():
    plain = trace_script.build_meta_transformer(TINY)
    chunked = trace_script.build_meta_transformer(TINY, ffn_chunk_rows=1024)
    peaks = [trace_script.trace_forward_peak(plain, trace_script.forward_inputs(n, TINY)).peak for n in (4000, 8000)]
    assert peaks[1] > 1.8 * peaks[0]
    chunked_peak = trace_script.trace_forward_peak(chunked, trace_script.forward_inputs(8000, TINY))
    assert chunked_peak.peak < peaks[1]


def test_too_few_rows_for_one_latent_frame_are_refused():
    with pytest.raises(ValueError, match="less than one latent frame"):
        trace_script.forward_inputs(1000, TINY)


def test_the_committed_trace_is_what_the_script_traces():
    committed = json.loads((ROOT / "benchmarks" / "results" / "activation_trace.json").read_text())
    assert committed["config"] == trace_script.RELEASED_TRANSFORMER_CONFIG
    index = committed["rows"].index(40_000)
    fresh = trace_script.trace(rows=[40_000], chunks=[8192])
    assert fresh["peaks_gib"]["8192"][0] == committed["peaks_gib"]["8192"][index]
    # the released DiT's rotary temporaries set the peak at 40k rows under an 8192-row feed-forward chunking
    assert "_apply_rotary_emb" in committed["at_peak"]["8192"][index]
