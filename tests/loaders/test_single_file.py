"""Single-file DiTs (`load_transformer_file`): ComfyUI-named bf16 safetensors, GGUF (Q8_0 / Q6_K / Q5_K / Q4_K) and
"fp8 scaled" files written here in their published layouts, pruned files with fewer blocks, and the one-line refusals.

References: a bf16 file must load bitwise to the weights `from_pretrained` gives (and to what diffusers'
`from_single_file` maps it to); a GGUF / fp8 file must run like a dense model holding the file's dequantized weights
(`gguf`'s own numpy dequantization; E4M3 code x scale), within the format's own dequantization."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors.torch import load_file, save_file

from diffusers_h3 import describe
from diffusers_h3.loaders import single_file
from diffusers_h3.loaders.single_file import (
    TransformerFileError,
    inspect_transformer_file,
    is_gguf_linear,
    load_transformer_file,
    transformer_file_record,
)
from diffusers_h3.quantizers import FP8Tensor
from diffusers_h3.testing.single_file import (
    GGUF_FALLBACK,
    dense_reference,
    gguf_plan,
    to_comfy_state_dict,
    write_comfy_safetensors,
    write_fp8_scaled_safetensors,
    write_gguf,
)
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_transformer, tiny_transformer_inputs


gguf = pytest.importorskip("gguf")

TINY = dict(TINY_TRANSFORMER_CONFIG)
# K-quants pack 256 input columns per block: a model whose block linears read 256 features (the AdaLN reads 32, so a
# K-quant file holds it in llama.cpp's fallback type, as H3's 2688-wide AdaLN in the published K-quant files).
KQUANT = dict(TINY_TRANSFORMER_CONFIG, hidden_size=256, attention_head_dim=128, ffn_dim=256, time_embed_dim=32)


def _model(config=TINY, seed=0):
    torch.manual_seed(seed)
    return tiny_transformer(**config)


def _run(model, seed=0):
    with torch.no_grad():
        return model(**tiny_transformer_inputs(seed=seed))[0]


def _rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def source():
    return _model()


@pytest.fixture(scope="module")
def saved_folder(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformer")
    source.save_pretrained(folder)
    return folder


# -- bf16 / dense files ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_comfy_bf16_file_loads_bitwise_like_from_pretrained(source, saved_folder, tmp_path, prefix):
    path = tmp_path / "h3_bf16.safetensors"
    write_comfy_safetensors(source, path, dtype=torch.bfloat16, prefix=prefix)
    loaded = load_transformer_file(path, saved_folder, dtype=torch.bfloat16)
    reference = MiniMaxH3Transformer3DModel.from_pretrained(saved_folder, torch_dtype=torch.bfloat16).eval()
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name in theirs:  # the float32 modules stay float32, the rest is the file's bf16
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    assert torch.equal(_run(loaded), _run(reference))
    record = transformer_file_record(loaded)
    assert record.format == "dense" and record.naming == "ComfyUI" and not record.quantized
    assert ("key prefix 'model.diffusion_model.' stripped" in record.notes) == bool(prefix)


def test_matches_diffusers_from_single_file(source, saved_folder, tmp_path):
    path = tmp_path / "h3_fp32.safetensors"
    write_comfy_safetensors(source, path, dtype=torch.float32)
    theirs = MiniMaxH3Transformer3DModel.from_single_file(
        str(path), config=str(saved_folder), torch_dtype=torch.float32, local_files_only=True
    ).state_dict()
    ours = load_transformer_file(path, saved_folder, dtype=torch.float32).state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)
    assert all(torch.equal(ours[n], source.state_dict()[n]) for n in ours)


def test_diffusers_named_single_file(source, tmp_path):
    path = tmp_path / "h3_diffusers.safetensors"
    save_file({n: t.contiguous() for n, t in source.state_dict().items()}, str(path))
    loaded = load_transformer_file(path, TINY, dtype=torch.float32)
    assert transformer_file_record(loaded).naming == "diffusers"
    assert torch.equal(_run(loaded), _run(source))


def test_pruned_file_with_fewer_blocks_loads_its_block_count(saved_folder, tmp_path):
    pruned = _model(dict(TINY, num_layers=1), seed=3)
    path = tmp_path / "h3_pruned.safetensors"
    write_comfy_safetensors(pruned, path, dtype=torch.float32)
    loaded = load_transformer_file(path, saved_folder, dtype=torch.float32)  # the folder's config says 2 blocks
    assert loaded.config.num_layers == 1 and len(loaded.transformer_blocks) == 1
    assert transformer_file_record(loaded).as_dict()["blocks"] == "1 (pruned: the config has 2)"
    assert torch.equal(_run(loaded), _run(pruned))
    with pytest.raises(TransformerFileError, match="holds 1 transformer blocks, not num_layers=2"):
        load_transformer_file(path, saved_folder, num_layers=2)


# -- curve-form ("pruned") AdaLN ----------------------------------------------------------------------------------------
GRID = 5  # table rows at t = 0, 0.25, 0.5, 0.75, 1 (exact in binary)


def _curve_file_tensors(model, tensors):
    """A ComfyUI-named file's tensors in the curve form that reproduces ``model`` exactly at the table's grid points:
    the table holds silu(time embedding) at t = i / (GRID - 1), each row computed alone as the forward computes it, and
    the AdaLN projections keep their weights (rank = the time embedder's width)."""
    rows = []
    with torch.no_grad():
        for i in range(GRID):
            t = torch.tensor([i / (GRID - 1)])
            rows.append(torch.nn.functional.silu(model.time_embedder(model.time_proj(t).float())))
    tensors = {n: t for n, t in tensors.items() if not n.startswith("time_embedder.")}
    tensors["adaln_t_table"] = torch.cat(rows).contiguous()
    return tensors


def _run_at(model, t):
    inputs = tiny_transformer_inputs()
    inputs["timestep"] = torch.tensor([t])
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled"])
def test_curve_form_pruned_file_matches_the_released_form_on_its_grid(source, tmp_path, fmt):
    path = tmp_path / f"h3_pruned_{fmt}.safetensors"
    if fmt == "bf16":
        write_comfy_safetensors(source, path, dtype=torch.float32)
        reference = source
    else:  # ComfyUI's pruned fp8-scaled layout: the same, with fp8-scaled block linears
        written = write_fp8_scaled_safetensors(source, path, dtype=torch.float32)
        reference = load_transformer_file(path, TINY, dtype=torch.float32, fp8_backend="dequant")
    save_file(_curve_file_tensors(source, load_file(str(path))), str(path))
    loaded = load_transformer_file(path, TINY, dtype=torch.float32, fp8_backend="dequant")
    assert "time_embedder.table" in loaded.state_dict() and "time_embedder.linear_1.weight" not in loaded.state_dict()
    for t in (0.0, 0.5, 1.0):  # on the grid the curve is the released embedding: the same output
        assert torch.equal(_run_at(loaded, t), _run_at(reference, t)), t
    assert not torch.equal(_run_at(loaded, 0.6), _run_at(reference, 0.6))  # between grid points: interpolated
    assert any("curve-form (pruned) AdaLN" in note for note in transformer_file_record(loaded).notes)
    assert fmt == "bf16" or written  # (the fp8 file's codes are the ones checked in the fp8 tests)


def test_curve_table_interpolates_between_its_rows():
    from diffusers_h3.loaders._curve_adaln import AdaLNCurveTable

    table = AdaLNCurveTable(GRID, 3)
    table.table.data = torch.randn(GRID, 3)
    rows = table.table.data
    got = table(torch.tensor([0.6, 0.0, 1.0, 1.7, -0.2]))
    weight = 0.6 * (GRID - 1) - 2  # t = 0.6 sits between rows 2 and 3
    torch.testing.assert_close(got[0], rows[2] * (1 - weight) + rows[3] * weight)
    assert torch.equal(got[1], rows[0]) and torch.equal(got[2], rows[-1])
    assert torch.equal(got[3], rows[-1]) and torch.equal(got[4], rows[0])  # clamped to [0, 1]


def test_curve_form_model_refuses_to_save(source, tmp_path):
    from diffusers_h3.loaders.single_file import check_saveable

    path = tmp_path / "h3_pruned.safetensors"
    write_comfy_safetensors(source, path)
    save_file(_curve_file_tensors(source, load_file(str(path))), str(path))
    with pytest.raises(ValueError, match="curve-form .*which a saved config.json cannot describe"):
        check_saveable(load_transformer_file(path, TINY))


def test_config_none_is_the_released_model(tmp_path, source):
    path = tmp_path / "h3.safetensors"
    write_comfy_safetensors(source, path)
    # The tiny file against the released config: refused on the first tensor whose width differs, before loading.
    with pytest.raises(TransformerFileError, match=r"hidden_size 5376, 56 heads x 128"):
        load_transformer_file(path)


# -- GGUF ----------------------------------------------------------------------------------------------------------------
def _gguf_tensor_bytes(path, name):
    reader = gguf.GGUFReader(str(path))
    data = next(t for t in reader.tensors if t.name == name).data
    return torch.from_numpy(np.array(data, copy=True)).view(torch.uint8)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K", "Q4_K"])
def test_gguf_file_runs_like_its_dequantized_weights(tmp_path, kind):
    model = _model(KQUANT, seed=1)
    path = tmp_path / f"h3-{kind}.gguf"
    decoded = write_gguf(model, path, kind)
    loaded = load_transformer_file(path, KQUANT, dtype=torch.float32)
    reference = dense_reference(KQUANT, decoded)
    # every block linear the file quantized is a GGUFLinear of its type (the AdaLN in the K-quants' fallback type, the
    # refiner F16); qkv_proj became three
    plan = gguf_plan(to_comfy_state_dict(model.state_dict()), kind)
    expected = Counter(dict.fromkeys(plan.values(), 0))
    for name, type_name in plan.items():
        expected[type_name] += 3 if "qkv_proj" in name else 1
    layers = Counter(m.weight.quant_type.name for m in loaded.modules() if is_gguf_linear(m))
    adaln = KQUANT["num_layers"]  # one AdaLN projection per block: in Q8_0 itself, or in a K-quant's fallback
    assert layers == expected and layers[kind] == 6 * KQUANT["num_layers"] + (adaln if kind == "Q8_0" else 0)
    assert kind == "Q8_0" or layers[GGUF_FALLBACK[kind]] == adaln
    # the packed blocks are the file's bytes, rows split as diffusers' converter splits them (no re-quantization)
    inner = KQUANT["num_attention_heads"] * KQUANT["attention_head_dim"]
    qkv = _gguf_tensor_bytes(path, "blocks.1.attn.qkv_proj.weight")
    assert torch.equal(loaded.transformer_blocks[1].attn.to_k.weight.as_tensor().view(torch.uint8), qkv[inner : 2 * inner])
    # the dequantized weights are the format's own (gguf's numpy decoder), up to diffusers' fp16 block arithmetic
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    for name, module in loaded.named_modules():
        if is_gguf_linear(module):
            want = reference.get_submodule(name).weight
            got = dequantize_gguf_tensor(module.weight).float()
            assert (got - want).abs().max() <= 2e-3 * want.abs().max(), name
    assert _rel_l2(_run(loaded), _run(reference)) < 5e-3
    assert transformer_file_record(loaded).format == "gguf"
    report = describe(loaded)["model"]["checkpoint_file"]
    assert f"{kind} x{layers[kind]}" in report["gguf_layers"] and "dequantize" in report["gguf_layers"]


def test_gguf_save_is_refused_in_one_line(tmp_path):
    from diffusers_h3.testing.tiny import tiny_pipeline

    model = _model()
    path = tmp_path / "h3-Q8_0.gguf"
    write_gguf(model, path, "Q8_0")
    pipe = tiny_pipeline()
    pipe.transformer = load_transformer_file(path, TINY, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"transformer holds \d+ GGUF layers .*cannot save") as error:
        pipe.save_pretrained(tmp_path / "saved")
    assert "\n" not in str(error.value) and not (tmp_path / "saved").exists()


# -- fp8 scaled ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("legacy", [False, True], ids=["weight_scale+comfy_quant", "scale_weight+scaled_fp8"])
def test_fp8_scaled_file_maps_codes_into_fp8_layers(tmp_path, legacy):
    model = _model(seed=2)
    path = tmp_path / "h3_fp8_scaled.safetensors"
    written = write_fp8_scaled_safetensors(model, path, dtype=torch.float32, legacy=legacy, input_scales=True)
    loaded = load_transformer_file(path, TINY, dtype=torch.float32, fp8_backend="dequant")
    scale_key = "scale_weight" if legacy else "weight_scale"
    # codes and scales straight from the file: the qkv stack split, fc1's [gate; value] swapped, no re-quantization
    inner = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    block = loaded.transformer_blocks[0]
    qkv = written["blocks.0.attn.qkv_proj.weight"].view(torch.uint8)
    for i, layer in enumerate((block.attn.to_q, block.attn.to_k, block.attn.to_v)):
        assert isinstance(getattr(layer, "weight", None), FP8Tensor)
        assert torch.equal(layer.weight.qdata.view(torch.uint8), qkv[i * inner : (i + 1) * inner])
        assert torch.equal(layer.weight.scale, written[f"blocks.0.attn.qkv_proj.{scale_key}"].expand(inner))
    gate, value = written["blocks.0.mlp.fc1.weight"].view(torch.uint8).chunk(2)
    assert torch.equal(block.ff.net[0].proj.weight.qdata.view(torch.uint8), torch.cat([value, gate]))
    fp8_layers = [m for m in loaded.modules() if isinstance(getattr(m, "weight", None), FP8Tensor)]
    assert len(fp8_layers) == 7 * TINY["num_layers"]  # q, k, v, out, fc1, fc2, AdaLN of every block
    # dequantized (backend "dequant"): exactly a dense model holding code x scale
    dequantized = {}
    for name, tensor in written.items():
        if tensor.dtype == torch.float8_e4m3fn and name != "scaled_fp8":
            dequantized[name] = tensor.float() * written[name.replace(".weight", f".{scale_key}")]
        elif tensor.dtype != torch.uint8 and not name.endswith(("scale_weight", "weight_scale", "scale_input",
                                                                  "input_scale", "scaled_fp8")):  # fmt: skip
            dequantized[name] = tensor
    reference = dense_reference(TINY, dequantized)
    assert torch.equal(_run(loaded), _run(reference))
    # the default path (CPU: the W8A8 numerics, activations quantized per token) stays within FP8's error
    auto = load_transformer_file(path, TINY, dtype=torch.float32)
    assert _rel_l2(_run(auto), _run(reference)) < 0.05
    record = transformer_file_record(loaded)
    assert record.format == "fp8_scaled" and record.tensor_types["F8_E4M3"] == 5 * TINY["num_layers"]
    assert any("static input scales of the file unused" in note for note in record.notes)


def test_fp8_scaled_model_saves_and_reloads_bitwise(tmp_path):
    model = _model(seed=4)
    path = tmp_path / "h3_fp8_scaled.safetensors"
    write_fp8_scaled_safetensors(model, path, dtype=torch.bfloat16)
    loaded = load_transformer_file(path, TINY, dtype=torch.bfloat16)
    loaded.save_pretrained(tmp_path / "saved")
    again = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "saved", torch_dtype=torch.bfloat16).eval()
    assert [n for n, m in again.named_modules() if isinstance(getattr(m, "weight", None), FP8Tensor)] == [
        n for n, m in loaded.named_modules() if isinstance(getattr(m, "weight", None), FP8Tensor)
    ]
    ours, theirs = loaded.state_dict(), again.state_dict()
    assert all(ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]) for n in ours)
    assert torch.equal(_run(loaded), _run(again))


# -- refusals: one line, before any tensor data is read -----------------------------------------------------------------
def _comfy(model=None):
    return {n: t.contiguous() for n, t in to_comfy_state_dict((model or _model()).state_dict()).items()}


def _fp8_tensors(tmp_path):
    write_fp8_scaled_safetensors(_model(), tmp_path / "fp8.safetensors")
    return load_file(str(tmp_path / "fp8.safetensors"))


def _bad_safetensors(case, tmp_path):
    tensors = _comfy()
    if case == "missing tensor":
        tensors.pop("blocks.1.mlp.fc2.weight")
    elif case == "extra tensor":
        tensors["blocks.0.attn.to_gate_compress.weight"] = torch.zeros(64, 32)
    elif case == "malformed curve table":
        tensors["adaln_t_table"] = torch.zeros(1025)
    elif case == "block gap":
        tensors = {n.replace("blocks.1.", "blocks.2.", 1) if n.startswith("blocks.1.") else n: t for n, t in tensors.items()}
    elif case == "int8 layer":
        tensors = _fp8_tensors(tmp_path)
        tensors["blocks.0.mlp.fc2.weight"] = torch.zeros(32, 64, dtype=torch.int8)
        tensors["blocks.0.mlp.fc2.comfy_quant"] = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()),
                                                              dtype=torch.uint8)  # fmt: skip
    elif case == "e5m2 layer":
        tensors["blocks.0.mlp.fc2.weight"] = tensors["blocks.0.mlp.fc2.weight"].to(torch.float8_e5m2)
    elif case == "fp8 without scales":
        tensors = {n: t for n, t in _fp8_tensors(tmp_path).items() if not n.endswith((".weight_scale", ".comfy_quant"))}
    path = tmp_path / f"{case.replace(' ', '_')}.safetensors"
    save_file(tensors, str(path))
    return path


REFUSALS = {
    "missing tensor": "tensors the model needs are not in the file",
    "extra tensor": "are not MiniMax-H3 DiT tensors",
    "malformed curve table": r"adaln_t_table is \[1025\] F32, not a \[grid, rank\] float table",
    "block gap": "with 1 missing",
    "int8 layer": "ComfyUI format 'int8_tensorwise'",
    "e5m2 layer": "stored as F8_E5M2",
    "fp8 without scales": "have no per-layer scale",
}


@pytest.fixture
def no_tensor_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read before the file was checked")

    monkeypatch.setattr(single_file, "_read_tensors", refuse)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_wrong_safetensors_files_are_refused_in_one_line(case, tmp_path, no_tensor_reads):
    path = _bad_safetensors(case, tmp_path)
    with pytest.raises(TransformerFileError, match=REFUSALS[case]) as error:
        load_transformer_file(path, TINY)
    assert "\n" not in str(error.value) and str(path) in str(error.value) and " — " in str(error.value)


def test_wrong_shapes_name_the_tensor_and_the_config(tmp_path, no_tensor_reads):
    path = tmp_path / "h3.safetensors"
    write_comfy_safetensors(_model(), path)
    with pytest.raises(TransformerFileError, match=r"mlp\.fc1\.weight' is \[128, 32\] .*ffn_dim 128"):
        load_transformer_file(path, dict(TINY, ffn_dim=128))


def test_gguf_of_a_type_diffusers_cannot_read_is_refused(tmp_path, no_tensor_reads):
    path = tmp_path / "h3-Q8_CR.gguf"
    writer = gguf.GGUFWriter(path=None, arch="minimax_h3")
    for name, tensor in _comfy().items():
        if name == "blocks.0.mlp.fc2.weight":  # ComfyUI's int8 ConvRot GGUFs store codes as I8
            writer.add_tensor(name, np.zeros(tuple(tensor.shape), np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
        else:
            writer.add_tensor(name, tensor.float().numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TransformerFileError, match=r"'blocks\.0\.mlp\.fc2\.weight' is stored as GGUF type I8"):
        load_transformer_file(path, TINY)


def test_quantizing_an_already_quantized_file_is_refused(tmp_path, no_tensor_reads):
    from diffusers_h3 import FP8Config

    path = tmp_path / "h3-Q8_0.gguf"
    write_gguf(_model(), path, "Q8_0")
    with pytest.raises(TransformerFileError, match=r"already quantized \(gguf\)"):
        load_transformer_file(path, TINY, quantization_config=FP8Config())


@pytest.mark.parametrize("name, message", [("h3.ckpt", "not a single-file DiT format"), ("absent.gguf", "no such file"),
                                           ("folder", "is a folder")])  # fmt: skip
def test_wrong_paths_are_refused(tmp_path, name, message):
    path = tmp_path / name
    if name == "folder":
        path.mkdir()
    elif name.endswith(".ckpt"):
        path.write_bytes(b"x")
    with pytest.raises(TransformerFileError, match=message):
        inspect_transformer_file(path, TINY)


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "h3.safetensors"
    write_comfy_safetensors(_model(), path)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(TransformerFileError, match="truncated"):
        inspect_transformer_file(path, TINY)


def test_dense_file_can_be_quantized_after_loading(tmp_path):
    from diffusers_h3 import W8A16Config
    from diffusers_h3.quantizers import W8A16Tensor

    path = tmp_path / "h3.safetensors"
    write_comfy_safetensors(_model(), path, dtype=torch.float32)
    loaded = load_transformer_file(path, TINY, dtype=torch.float32, quantization_config=W8A16Config())
    assert any(isinstance(getattr(m, "weight", None), W8A16Tensor) for m in loaded.modules())
    assert "quantized after loading with W8A16Config" in transformer_file_record(loaded).notes
