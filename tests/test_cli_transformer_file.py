"""`--transformer-file`: the DiT from one .safetensors / .gguf file, the rest of the pipeline from `--model`. A tiny
pipeline end to end on CPU, and the mistakes refused in one line before any model loads."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from diffusers_h3 import cli
from diffusers_h3.testing.single_file import to_comfy_state_dict, write_comfy_safetensors, write_gguf
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline

from .test_cli_errors import no_loading  # noqa: F401 (the fixture: any model load fails the test)


pytest.importorskip("gguf")

REQUEST = ["--prompt", "a cat", "--steps", "2", "--device", "cpu", "--frames", str(TINY_NUM_FRAMES),
           "--height", "32", "--width", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe")
    pipe = tiny_pipeline(with_transformer_ref=False)
    pipe.save_pretrained(path / "pipe")
    write_gguf(pipe.transformer, path / "h3-Q8_0.gguf", "Q8_0")
    write_comfy_safetensors(pipe.transformer, path / "h3_bf16.safetensors")
    return path


def test_generate_and_describe_with_a_gguf_dit(folder, tmp_path, capsys):
    out = tmp_path / "clip.mp4"
    argv = ["--model", str(folder / "pipe"), "--transformer-file", str(folder / "h3-Q8_0.gguf")]
    assert cli.main(["generate", *argv, *REQUEST, "--out", str(out)]) == 0
    assert out.is_file() and out.stat().st_size > 0
    assert "transformer: GGUF file h3-Q8_0.gguf (Q8_0 x" in capsys.readouterr().err
    assert cli.main(["describe", *argv, "--device", "cpu", "--json"]) == 0
    transformer = json.loads(capsys.readouterr().out)["components"]["transformer"]
    assert transformer["quantization"] == "GGUFQuantizationConfig"
    assert "diffusers' dequantize path" in transformer["checkpoint_file"]["gguf_layers"]


@pytest.fixture
def no_reads(request, monkeypatch):
    """No model loads (`no_loading`) and no tensor of the file is read: the checks answer from the header."""
    tmp_path = request.getfixturevalue("no_loading")

    def refuse(*args, **kwargs):
        raise AssertionError("the file's tensors were read before the input checks")

    monkeypatch.setattr("diffusers_h3.loaders.single_file._read_tensors", refuse)
    return tmp_path


def _fails(argv, capsys, *expected):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("diffusers-h3: error: --transformer-file") and " — " in err
    for text in expected:
        assert text in err, err
    return err


def _bad_file(folder, tmp_path, case):
    if case == "missing":
        return tmp_path / "absent.gguf"
    if case == "suffix":
        path = tmp_path / "h3.ckpt"
        path.write_bytes(b"\x80\x02")
        return path
    if case == "not gguf":
        path = tmp_path / "h3.gguf"
        path.write_bytes(b"PK\x03\x04" + bytes(60))
        return path
    if case == "truncated":
        path = tmp_path / "h3.safetensors"
        path.write_bytes((folder / "h3_bf16.safetensors").read_bytes()[:-5])
        return path
    if case == "missing tensor":
        from safetensors.torch import load_file

        tensors = load_file(str(folder / "h3_bf16.safetensors"))
        tensors.pop("final_layer.video_out.weight")
        path = tmp_path / "h3_partial.safetensors"
        save_file(tensors, str(path))
        return path
    raise AssertionError(case)


CASES = {
    "missing": "no such file",
    "suffix": "a .ckpt file is not a single-file DiT format",
    "not gguf": "not a GGUF file",
    "truncated": "truncated",
    "missing tensor": "1 tensors the model needs are not in the file",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_transformer_files_are_refused_before_loading(case, folder, tmp_path, capsys, no_reads):
    path = _bad_file(folder, tmp_path, case)
    argv = ["generate", "--model", str(folder / "pipe"), "--transformer-file", str(path), *REQUEST,
            "--out", str(tmp_path / "x.mp4")]  # fmt: skip
    _fails(argv, capsys, CASES[case])
    assert not (tmp_path / "x.mp4").exists()


def test_a_quantized_file_refuses_quantize(folder, tmp_path, capsys, no_reads):
    argv = ["generate", "--model", str(folder / "pipe"), "--transformer-file", str(folder / "h3-Q8_0.gguf"),
            "--quantize", "w8a16", *REQUEST, "--out", str(tmp_path / "x.mp4")]  # fmt: skip
    _fails(argv, capsys, "already quantized (gguf)", "drop --quantize")


def test_a_file_of_another_config_is_refused(folder, tmp_path, capsys, no_reads):
    bigger = tiny_pipeline(with_transformer_ref=False, seed=1).transformer
    state = {n: t.repeat(2, *([1] * (t.dim() - 1))).contiguous() if n.endswith("mlp.fc2.weight") else t.contiguous()
             for n, t in to_comfy_state_dict(bigger.state_dict()).items()}  # fmt: skip
    path = tmp_path / "h3_other.safetensors"
    save_file(state, str(path))
    argv = ["generate", "--model", str(folder / "pipe"), "--transformer-file", str(path), *REQUEST,
            "--out", str(tmp_path / "x.mp4")]  # fmt: skip
    _fails(argv, capsys, "mlp.fc2.weight' is [64, 64]", "pass the config of the model the file was saved from")


def test_describe_needs_a_pipeline_for_the_file(folder, capsys, no_reads):
    _fails(["describe", "--transformer-file", str(folder / "h3-Q8_0.gguf")], capsys, "add --model (or --demo)")


def test_transformer_file_is_in_the_help():
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--transformer-file PATH" in help_text and "docs/checkpoints.md" in help_text
