"""`diffusers-h3 train-lora` on the embedded tiny demo checkpoint."""

import pytest
import torch

from diffusers_h3.cli import main, parse_arguments

from .training.conftest import one_thread, write_two_clips


DEMO_ARGS = ["--height", "64", "--width", "96", "--frames", "22", "--dtype", "float32", "--device", "cpu"]


def test_train_lora_on_the_demo_checkpoint_writes_a_lora_that_changes_the_output(tmp_path, capsys):
    from diffusers_h3.testing.tiny import demo_checkpoint_dir, tiny_transformer_inputs
    from diffusers_h3.training.cache import _load_pipeline

    data = write_two_clips(tmp_path / "data")
    out = tmp_path / "out"
    with one_thread():
        code = main(["train-lora", "--data", str(data), "--output", str(out), *DEMO_ARGS, "--rank", "4", "--steps",
                     "3", "--learning-rate", "1e-2", "--checkpointing-steps", "0"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr()
    assert "trained 3 steps" in printed.out and "embedded tiny demo checkpoint" in printed.err
    for name in ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors", "adapter_config.json", "README.md"):
        assert (out / name).is_file()
    outputs = []
    for lora in (None, out / "pytorch_lora_weights.safetensors", out / "lora_comfyui.safetensors"):
        pipe = _load_pipeline(str(demo_checkpoint_dir()), ("transformer",), "t2va", torch.float32, "cpu")
        if lora is not None:
            pipe.load_lora_weights(str(lora), adapter_name="cli")
        with torch.no_grad():
            outputs.append(pipe.transformer(**tiny_transformer_inputs(seed=1), return_dict=False)[0])
    base, diffusers_layout, comfy_layout = outputs
    assert not torch.allclose(diffusers_layout, base, atol=1e-6)
    assert torch.allclose(comfy_layout, diffusers_layout, rtol=1e-4, atol=1e-6)


def test_train_lora_argument_mistakes_answer_before_any_import(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["train-lora", "--data", str(tmp_path), "--output", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "no metadata.jsonl" in capsys.readouterr().err
    (tmp_path / "metadata.jsonl").write_text("")
    with pytest.raises(SystemExit):
        parse_arguments(["train-lora", "--data", str(tmp_path), "--output", str(tmp_path / "o"), "--frames", "30"])
    assert "--frames 30 is not 17n+5" in capsys.readouterr().err


def test_train_lora_bad_data_folder_is_one_line(tmp_path, capsys):
    data = write_two_clips(tmp_path / "data")
    (data / "metadata.jsonl").write_text('{"file_name": "clip0.mp4", "text": "fine"}\n{"file_name": "clip1.mp4"}\n')
    from diffusers_h3.testing.tiny import demo_checkpoint_dir

    checkpoint = demo_checkpoint_dir()  # written on first use, with progress bars: not part of the one line
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["train-lora", "--model", str(checkpoint), "--data", str(data), "--output", str(tmp_path / "out"),
              *DEMO_ARGS])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "clip1.mp4: no caption" in err and err.startswith("diffusers-h3: error:")
