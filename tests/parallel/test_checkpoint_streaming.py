"""Streaming a model's weights from its own checkpoint files: same outputs, no weights left in memory, nothing
written, and a model that does not match its files is refused before anything is released."""

import time

import pytest
import torch

from diffusers_h3.parallel import memory_budget as mb
from diffusers_h3.parallel.checkpoint_streaming import (
    STREAM_HOOK_NAME,
    CheckpointMismatchError,
    stream_from_checkpoint,
    streamed_bytes,
)
from diffusers_h3.pipelines import MiniMaxH3Pipeline
from diffusers_h3.quantizers import W8A16Config
from diffusers_h3.testing import tiny


def _saved_w8a16_text_encoder(folder):
    te = tiny.tiny_text_encoder(num_hidden_layers=3, hidden_size=32)
    te.save_pretrained(folder / "dense")
    cls = type(te)
    quantized = cls.from_pretrained(folder / "dense", quantization_config=W8A16Config(), dtype=torch.bfloat16)
    quantized.save_pretrained(folder / "w8a16", max_shard_size="20KB")  # several shards: an index and many files
    return cls


def _hidden(te, ids):
    with torch.no_grad():
        return te.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def test_streamed_model_gives_the_same_output_and_holds_no_weights(tmp_path):
    cls = _saved_w8a16_text_encoder(tmp_path)
    assert len(list((tmp_path / "w8a16").glob("*.safetensors"))) > 1
    reference = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval()
    streamed = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval()
    files_before = sorted(p.name for p in (tmp_path / "w8a16").iterdir())
    sizes = stream_from_checkpoint(streamed, tmp_path / "w8a16", "cpu", resident_below_bytes=1024)
    held = sum(t.numel() * t.element_size() for t in streamed.state_dict().values())
    total = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    assert sizes["streamed_bytes_per_forward"] > 0.5 * total
    assert streamed_bytes(streamed) == sizes["streamed_bytes_per_forward"] and streamed_bytes(reference) == 0
    assert held <= total - sizes["streamed_bytes_per_forward"]
    ids = torch.randint(0, 200, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = _hidden(reference, ids)
    for _ in range(2):  # the tensors are released after each forward and read again
        assert torch.equal(_hidden(streamed, ids), expected)
    assert streamed.model.language_model.layers[0].mlp.up_proj.weight.qdata.numel() == 0  # released again (packed codes)
    assert sorted(p.name for p in (tmp_path / "w8a16").iterdir()) == files_before  # nothing written


def test_a_model_that_does_not_match_its_files_is_refused_before_anything_changes(tmp_path):
    cls = _saved_w8a16_text_encoder(tmp_path)
    # quantized while loading from the dense files: the int8 codes are not what those files store
    quantized = cls.from_pretrained(tmp_path / "dense", quantization_config=W8A16Config(), dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in quantized.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="in the model but"):
        stream_from_checkpoint(quantized, tmp_path / "dense", "cpu")
    after = quantized.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(hasattr(m, "_diffusers_hook") for m in quantized.modules())
    with pytest.raises(CheckpointMismatchError, match="no safetensors files"):
        stream_from_checkpoint(quantized, tmp_path / "empty", "cpu")


def test_streamed_text_encoder_encodes_the_prompt_as_the_resident_one(tmp_path, monkeypatch):
    from diffusers_h3.parallel import checkpoint_streaming

    monkeypatch.setattr(checkpoint_streaming, "RESIDENT_BELOW_BYTES", 1024)  # the tiny model streams too
    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    pipe = MiniMaxH3Pipeline(**components)
    expected, tags = pipe.encode_prompt("a red fox runs through snow", device="cpu")
    pipe.text_encoder.save_pretrained(tmp_path / "te")
    where = mb.stream_text_encoder_from_disk(pipe, "cpu", checkpoint_folder=tmp_path / "te")
    assert where == str(tmp_path / "te")
    assert pipe._diffusers_h3_placement["text_encoder"].startswith("streamed from its checkpoint files")
    hooked = [m for m in pipe.text_encoder.modules() if getattr(m, "_diffusers_hook", None) is not None
              and m._diffusers_hook.get_hook(STREAM_HOOK_NAME) is not None]  # fmt: skip
    assert hooked
    got, got_tags = pipe.encode_prompt("a red fox runs through snow", device="cpu")
    assert torch.equal(got, expected) and torch.equal(got_tags, tags)


@pytest.mark.gpu
def test_streaming_to_the_gpu_reads_each_tensor_onto_it(tmp_path):
    cls = _saved_w8a16_text_encoder(tmp_path)
    reference = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval().to("cuda")
    streamed = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval()
    stream_from_checkpoint(streamed, tmp_path / "w8a16", "cuda", resident_below_bytes=1024)
    ids = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(2)).cuda()
    expected = _hidden(reference, ids)  # first: cuBLAS allocates its workspace at the first GEMM of a stream
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    got = _hidden(streamed, ids)
    assert got.device.type == "cuda" and torch.equal(got, expected)
    del got
    from diffusers_h3.parallel.checkpoint_streaming import release_streamed_weights

    release_streamed_weights(streamed)  # the layers read ahead for the next call
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # frees of buffers the compute stream used are deferred until its events are polled
    assert torch.cuda.memory_allocated() <= allocated  # the streamed tensors are released after the forward


# -- the DiT and the VAE: groups, read-ahead, casts, refusals ---------------------------------------------------------


def _saved_dit(folder, dtype=torch.float32, **overrides):
    model = tiny.tiny_transformer(**overrides).to(dtype)
    model.save_pretrained(folder, max_shard_size="40KB")  # several shards, as a converted checkpoint has
    return model


def _load_dit(folder, dtype=torch.float32):
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=dtype).eval()


def _resident_dit(folder, dtype=torch.float32):
    """The in-memory reference, each tensor in memory of its own: loaded tensors can be views of the file's mapping
    at any byte offset, and the CPU GEMM's rounding depends on the pointer's alignment (streamed tensors are
    aligned)."""
    model = _load_dit(folder, dtype)
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensor.data = tensor.data.clone()
    return model


def _forward(model, seed=0):
    with torch.no_grad():
        return model(**tiny.tiny_transformer_inputs(seed=seed), return_dict=False)[0]


def _record_of(model):
    from diffusers_h3.parallel.checkpoint_streaming import streaming_of

    return streaming_of(model)


def test_streamed_dit_matches_the_resident_one_block_by_block(tmp_path):
    from diffusers_h3.parallel.checkpoint_streaming import StreamingConfig

    _saved_dit(tmp_path / "dit")
    reference, streamed = _resident_dit(tmp_path / "dit"), _load_dit(tmp_path / "dit")
    sizes = stream_from_checkpoint(streamed, tmp_path / "dit", "cpu", StreamingConfig(read_ahead=2),
                                   resident_below_bytes=256)  # fmt: skip
    blocks = streamed.transformer_blocks
    hooked = {path for path, m in streamed.named_modules() if get_hook(m) is not None}
    assert {f"transformer_blocks.{i}" for i in range(len(blocks))} <= hooked  # one group per block
    assert not any(p.startswith("transformer_blocks.0.") for p in hooked)  # ...not per leaf inside it
    record = _record_of(streamed)
    for seed in (0, 1, 2):
        before = dict(record.stats.as_dict())
        assert torch.equal(_forward(streamed, seed), _forward(reference, seed))
        assert all(p.numel() == 0 for p in blocks.parameters())  # released after each forward
    # by the third forward the order is learned: every group read ahead once, nothing read for nothing
    assert record.stats.group_loads - before["group_loads"] == record.groups
    assert record.stats.misses == before["misses"] and record.stats.dropped_prefetches == before["dropped_prefetches"]
    assert record.streamed_bytes_per_forward == sizes["streamed_bytes_per_forward"] > 0


def get_hook(module):
    registry = getattr(module, "_diffusers_hook", None)
    return None if registry is None else registry.get_hook(STREAM_HOOK_NAME)


def test_read_ahead_follows_the_order_the_groups_ran_in(tmp_path, monkeypatch):
    """Before any forward the reader guesses definition order; afterwards it reads ahead in the order the groups
    last ran, so a model that skips groups (an early exit, a cached refiner) has no misses from its second call on."""
    from diffusers_h3.parallel import checkpoint_streaming as cs

    _saved_dit(tmp_path / "dit")
    streamed = _load_dit(tmp_path / "dit")
    stream_from_checkpoint(streamed, tmp_path / "dit", "cpu", cs.StreamingConfig(read_ahead=1), resident_below_bytes=256)
    reads = []
    original = cs._Streamer._read
    monkeypatch.setattr(cs._Streamer, "_read", lambda self, group: reads.append(group.name) or original(self, group))
    ran = []
    for block in streamed.transformer_blocks:  # skip every other block: an order definition order does not predict
        block.register_forward_pre_hook(lambda m, a, name=None: ran.append(m))
    skipped = streamed.transformer_blocks[1]
    original_forward = skipped.forward
    skipped.forward = lambda hidden_states, *a, **k: hidden_states  # noqa: E731 - the group's hooks never run
    stats = _record_of(streamed).stats
    _forward(streamed)
    first_misses = stats.misses
    assert first_misses >= 1
    _wait_for_reads(streamed)  # the reads the first forward started are counted with it, not with the second
    before = (stats.misses, len(reads))
    _forward(streamed)
    assert stats.misses == before[0]  # every group read ahead, in the learned order
    second = reads[before[1]:]
    assert "transformer_blocks.1" not in second
    skipped.forward = original_forward


def _wait_for_reads(model):
    """Wait until the reader is idle without dropping what it read ahead (which release_streamed_weights drops)."""
    from diffusers_h3._hooks import H3_CHECKPOINT_STREAM_MODEL_HOOK, get_h3_hook

    get_h3_hook(model, H3_CHECKPOINT_STREAM_MODEL_HOOK).streamer.wait_for_reads()


def test_streamed_tensors_arrive_in_the_models_dtype(tmp_path):
    """Files in float32, model loaded in bfloat16: each streamed tensor is cast as it arrives, never used in the
    stored precision."""
    _saved_dit(tmp_path / "dit", dtype=torch.float32)
    reference = _resident_dit(tmp_path / "dit", torch.bfloat16)
    streamed = _load_dit(tmp_path / "dit", torch.bfloat16)
    stream_from_checkpoint(streamed, tmp_path / "dit", "cpu", resident_below_bytes=256)
    seen = []
    linear = streamed.transformer_blocks[0].ff.net[2]
    linear.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    inputs = {k: (v.to(torch.bfloat16) if v.is_floating_point() and k != "timestep" else v)
              for k, v in tiny.tiny_transformer_inputs().items()}  # fmt: skip
    with torch.no_grad():
        got = streamed(**inputs, return_dict=False)[0]
        expected = reference(**inputs, return_dict=False)[0]
    assert seen == [torch.bfloat16]
    assert torch.equal(got, expected)


def test_a_shape_that_differs_from_the_files_is_refused_before_any_weight_is_released(tmp_path):
    _saved_dit(tmp_path / "dit")
    model = _load_dit(tmp_path / "dit")
    block = model.transformer_blocks[1].ff.net[2]
    block.weight = torch.nn.Parameter(torch.zeros(block.weight.shape[0], block.weight.shape[1] + 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"transformer_blocks\.1\.ff\.net\.2\.weight is .* in the model but"):
        stream_from_checkpoint(model, tmp_path / "dit", "cpu", resident_below_bytes=256)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _record_of(model) is None and get_hook(model.transformer_blocks[0]) is None


def _slow_reads(monkeypatch, seconds):
    """Each group's read takes ``seconds`` longer, as on a busy machine or a slow disk: reads started ahead are
    still running when the forward returns."""
    from diffusers_h3.parallel import checkpoint_streaming as cs

    original = cs._Streamer._read
    monkeypatch.setattr(cs._Streamer, "_read", lambda self, group: time.sleep(seconds) or original(self, group))


@pytest.mark.parametrize("read_delay_s", [0.0, 0.05], ids=["reads-as-they-come", "slow-reads"])
def test_reads_use_no_mapping_and_drop_the_page_cache(tmp_path, monkeypatch, read_delay_s):
    from diffusers_h3.parallel import checkpoint_streaming as cs

    _saved_dit(tmp_path / "dit")
    _slow_reads(monkeypatch, read_delay_s)
    calls = []
    monkeypatch.setattr(cs.os, "posix_fadvise", lambda fd, start, n, advice: calls.append(advice))
    for drop in (True, False):
        calls.clear()
        streamed = _load_dit(tmp_path / "dit")
        stream_from_checkpoint(streamed, tmp_path / "dit", "cpu", cs.StreamingConfig(drop_page_cache=drop),
                               resident_below_bytes=256)  # fmt: skip
        mapped = []
        streamed.transformer_blocks[0].register_forward_pre_hook(
            lambda m, a: mapped.extend(line for line in open("/proc/self/maps") if str(tmp_path / "dit") in line))
        _forward(streamed)
        # the reads started ahead for a next forward end here, not during the next pass (whose list they would fill)
        cs.release_streamed_weights(streamed)
        assert mapped == []  # pread into our buffers: no file page is mapped into the process
        assert (calls and set(calls) == {cs.os.POSIX_FADV_DONTNEED}) if drop else not calls


def test_held_groups_stay_until_released(tmp_path):
    from diffusers_h3.parallel.checkpoint_streaming import StreamingConfig, release_streamed_weights

    _saved_dit(tmp_path / "dit")
    streamed = _load_dit(tmp_path / "dit")
    stream_from_checkpoint(streamed, tmp_path / "dit", "cpu", StreamingConfig(hold=True), resident_below_bytes=256)
    first = _forward(streamed)
    record = _record_of(streamed)
    assert record.stats.group_loads == record.groups
    assert streamed.transformer_blocks[0].ff.net[2].weight.numel() > 0  # held after the forward
    assert torch.equal(_forward(streamed), first) and record.stats.group_loads == record.groups  # not read again
    release_streamed_weights(streamed)
    assert streamed.transformer_blocks[0].ff.net[2].weight.numel() == 0
    assert torch.equal(_forward(streamed), first) and record.stats.group_loads == 2 * record.groups


def _streamed_pointers_off_alignment(tmp_path, device):
    """Stream every tensor of a DiT (held, so all stay placed after a forward) and return those whose pointer is not
    on the module's alignment, with the number checked. Stored and run in float32: a tensor cast as it arrives is a
    new allocation, not a view of the buffer."""
    from diffusers_h3.parallel import checkpoint_streaming as cs

    dtype = torch.float32
    _saved_dit(tmp_path / "dit", dtype=dtype)
    streamed = _load_dit(tmp_path / "dit", dtype)
    config = cs.StreamingConfig(hold=True, slot_mib=1)
    stream_from_checkpoint(streamed, tmp_path / "dit", device, config, resident_below_bytes=0)
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() and k != "timestep" else v.to(device))
              for k, v in tiny.tiny_transformer_inputs().items()}  # fmt: skip
    with torch.no_grad():
        streamed(**inputs, return_dict=False)
    placed = streamed.state_dict()
    assert all(t.numel() and t.device.type == device for t in placed.values())  # every tensor streamed and held
    sizes = {t.numel() * t.element_size() % cs._ALIGN for t in placed.values()}
    assert sizes - {0}, "every tensor's size is a multiple of the alignment: packing them would go unnoticed"
    off = sorted(name for name, t in placed.items() if t.data_ptr() % cs._ALIGN)
    cs.release_streamed_weights(streamed)
    return off, len(placed)


def test_every_streamed_tensor_starts_on_an_aligned_address(tmp_path):
    """Kernels take other paths, with other rounding, for a misaligned pointer: each tensor of a group's buffer
    starts on the alignment, the buffer's own start included (the CPU allocator aligns to less)."""
    off, checked = _streamed_pointers_off_alignment(tmp_path, "cpu")
    assert checked > 10 and off == []


@pytest.mark.gpu
def test_every_tensor_streamed_to_the_gpu_starts_on_an_aligned_address(tmp_path):
    off, checked = _streamed_pointers_off_alignment(tmp_path, "cuda")
    assert checked > 10 and off == []


def test_streaming_options_are_checked():
    from diffusers_h3.parallel.checkpoint_streaming import StreamingConfig

    for bad in ({"read_ahead": -1}, {"pinned_slots": 0}, {"slot_mib": 1.5}):
        with pytest.raises(ValueError, match="StreamingConfig"):
            StreamingConfig(**bad)


@pytest.mark.gpu
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_streamed_dit_on_the_gpu_matches_the_resident_one_and_gives_its_memory_back(tmp_path, read_ahead):
    """The CUDA path: pinned ring, copy stream, read-ahead; bitwise the resident bf16 model on the GPU, and the
    device holds only the resident tensors once a forward is done."""
    from diffusers_h3.parallel.checkpoint_streaming import StreamingConfig

    _saved_dit(tmp_path / "dit", dtype=torch.bfloat16, num_layers=6)
    reference = _resident_dit(tmp_path / "dit", torch.bfloat16).to("cuda")
    streamed = _load_dit(tmp_path / "dit", torch.bfloat16)
    config = StreamingConfig(read_ahead=read_ahead, slot_mib=1)  # small slots: every group crosses several pieces
    stream_from_checkpoint(streamed, tmp_path / "dit", "cuda", config, resident_below_bytes=256)
    inputs = {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() and k != "timestep" else v.to("cuda"))
              for k, v in tiny.tiny_transformer_inputs().items()}  # fmt: skip
    with torch.no_grad():
        reference(**inputs, return_dict=False)  # cuBLAS allocates its workspace at the first GEMM of a stream
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with torch.no_grad():
        for _ in range(3):
            got = streamed(**inputs, return_dict=False)[0]
            expected = reference(**inputs, return_dict=False)[0]
            assert torch.equal(got, expected)
    del got, expected
    from diffusers_h3.parallel.checkpoint_streaming import release_streamed_weights

    release_streamed_weights(streamed)  # reads started ahead for the next forward
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline
    record = _record_of(streamed)
    assert record.stats.group_loads == 3 * record.groups
    if read_ahead:  # from the second forward on, every group was read ahead
        assert record.stats.misses <= record.groups
