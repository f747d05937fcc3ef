"""MP4 export (read back with PyAV) and the CLI on the embedded tiny demo checkpoint."""

import json

import av
import numpy as np
import pytest
import torch

from diffusers_h3 import export_to_video
from diffusers_h3.cli import main


def _read_back(path):
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0]
        info = {
            "video_codec": video.codec_context.name,
            "audio_codec": audio.codec_context.name,
            "channels": audio.codec_context.channels if hasattr(audio.codec_context, "channels") else audio.layout.nb_channels,
            "sample_rate": audio.codec_context.sample_rate,
            "size": (video.codec_context.width, video.codec_context.height),
        }
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    with av.open(str(path)) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
    info["num_frames"], info["num_samples"], info["first_frame"] = len(frames), samples, frames[0]
    return info


def test_export_writes_h264_and_aac_stereo(tmp_path):
    # A smooth picture (chroma is subsampled 2x2 in yuv420p) whose brightness changes over time.
    yy, xx = np.meshgrid(np.linspace(0, 1, 64), np.linspace(0, 1, 96), indexing="ij")
    picture = np.stack([yy, xx, 0.5 * (yy + xx)], axis=-1)
    frames = np.stack([picture * (0.5 + 0.5 * i / 47) for i in range(48)])[None].astype(np.float32)  # (1, 48, H, W, 3)
    seconds = 48 / 24
    t = np.arange(int(32000 * seconds)) / 32000
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)])[None].astype(np.float32)
    path = export_to_video(frames, tmp_path / "clip.mp4", fps=24, audio=audio, sampling_rate=32000)
    info = _read_back(path)
    assert info["video_codec"] == "h264" and info["audio_codec"] == "aac"
    assert info["channels"] == 2 and info["sample_rate"] == 32000
    assert info["size"] == (96, 64) and info["num_frames"] == 48
    # AAC pads with priming/trailing frames; the decoded duration must match to within two 1024-sample frames.
    assert abs(info["num_samples"] - audio.shape[-1]) <= 2048
    # Lossy, but the picture must be the one we wrote.
    assert np.abs(info["first_frame"].astype(float) - frames[0, 0] * 255).mean() < 4


def test_export_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="stereo"):
        export_to_video(np.zeros((4, 32, 32, 3), np.float32), tmp_path / "a.mp4", audio=np.zeros((3, 100)))
    with pytest.raises(ValueError, match="even height and width"):
        export_to_video(np.zeros((4, 33, 32, 3), np.float32), tmp_path / "b.mp4")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        export_to_video(np.full((4, 32, 32, 3), 3.0, np.float32), tmp_path / "c.mp4")


def test_cli_generate_demo_writes_clip(tmp_path, monkeypatch, capsys):
    from diffusers_h3.pipelines import export

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "demo.mp4"
    # The clip is written while the video decodes: one write per temporal chunk of the VAE, not one for the clip.
    chunks = []
    write_frames = export.VideoWriter.write_frames
    monkeypatch.setattr(export.VideoWriter, "write_frames",
                        lambda self, frames: chunks.append(len(frames)) or write_frames(self, frames))  # fmt: skip
    # The export options reach the file: yuv444p is not the default, and the writer must not fall back to yuv420p.
    assert main(["generate", "--prompt", "a cat", "--out", str(out), "--steps", "3", "--seed", "1", "--device", "cpu",
                 "--crf", "30", "--preset", "ultrafast", "--pix-fmt", "yuv444p"]) == 0  # fmt: skip
    info = _read_back(out)
    assert info["num_frames"] == 124 and info["channels"] == 2 and info["size"] == (96, 64)
    with av.open(str(out)) as container:
        assert container.streams.video[0].codec_context.pix_fmt == "yuv444p"
    assert chunks == [17] * 6 + [22]
    printed = capsys.readouterr().out
    assert "wrote" in printed and "video streamed: each decoded chunk encoded while the next decodes" in printed
    assert "crf 30, preset ultrafast, yuv444p" in printed


def test_cli_generate_takes_the_speed_presets_export_settings(tmp_path, monkeypatch, capsys):
    from diffusers_h3.pipelines import speed_presets

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    chosen = {"crf": 28, "preset": "veryfast", "pix_fmt": "yuv444p"}
    monkeypatch.setitem(speed_presets.EXPORT_SETTINGS, "exact", chosen)
    out = tmp_path / "exact.mp4"
    assert main(["generate", "--prompt", "a cat", "--out", str(out), "--steps", "2", "--device", "cpu",
                 "--speed", "exact", "--crf", "20"]) == 0  # fmt: skip
    with av.open(str(out)) as container:
        assert container.streams.video[0].codec_context.pix_fmt == "yuv444p"
    assert "crf 20, preset veryfast, yuv444p" in capsys.readouterr().out  # --crf given, the rest the preset's


def test_cli_describe_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["describe", "--demo", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["environment"]["torch"] == torch.__version__
    assert "transformer" in report["components"]
    assert report["pipeline"]["partitions"] == ["transformer"]
    assert any("backend" in path for path in report["components"]["transformer"]["attention"])


def test_cli_generate_with_fast_paths(tmp_path, monkeypatch, capsys):
    # VSA in FP8 (emulated on CPU), the DiT quantized to W8A16 while loading, a LoRA on the quantized layers and the
    # compile switch; the CLI reports the path each part ran.
    from diffusers import MiniMaxH3Transformer3DModel
    from safetensors.torch import save_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    compiled = []
    monkeypatch.setattr(MiniMaxH3Transformer3DModel, "compile_repeated_blocks",
                        lambda self, **kw: compiled.append(kw), raising=False)
    lora = tmp_path / "style.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(64, 4)}, str(lora))
    out = tmp_path / "fast.mp4"
    argv = ["generate", "--prompt", "a cat", "--out", str(out), "--steps", "3", "--device", "cpu", "--vsa", "0.75",
            "--attention-precision", "fp8", "--quantize", "w8a16", "--quantize-text-encoder", "fp8", "--lora", str(lora),
            "--compile"]
    assert main(argv) == 0
    assert _read_back(out)["num_frames"] == 124
    printed = capsys.readouterr()
    assert "VSA sparsity=0.75" in printed.out and "FP8" in printed.out
    assert "transformer quantized layers" in printed.out and "W8A16Linear" in printed.out
    assert "text_encoder quantized layers" in printed.out and "FP8Linear" in printed.out
    assert "LoRA adapter 'cli'" in printed.err and "transformer: 1 modules" in printed.err
    assert "LoRA [cli(r=4" in printed.out  # the wrapped quantized layer reports its LoRA
    assert compiled == [{"fullgraph": False}]


def test_cli_rejects_bad_fast_path_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--vsa", "1.5"])
    assert "sparsity must be in [0.0, 1.0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--quantize", "int3"])


def test_cli_low_memory_placement_runs_and_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "low.mp4"
    assert main(["generate", "--prompt", "a cat", "--out", str(out), "--steps", "2", "--device", "cpu",
                 "--low-memory"]) == 0  # fmt: skip
    assert _read_back(out)["num_frames"] == 124
    printed = capsys.readouterr()
    assert "low-memory placement" in printed.err and "group offload (block level" in printed.err
    assert main(["describe", "--demo", "--json", "--device", "cpu", "--low-memory"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["placement"]["transformer"].startswith("group offload (block level")
    assert "decoder layers kept" in report["placement"]["text_encoder_layers"]


@pytest.mark.parametrize("speed, choice, expected", [
    ("exact", None, "FlashInfer FA3"), ("exact", "on", "FlashInfer FA3"), ("exact", "off", "diffusers"),
    ("fast", None, "dense INT8"), ("fast", "on", "FlashInfer FA3 FP8"), ("fast", "off", "dense INT8"),
])  # fmt: skip
def test_cli_flashinfer_choice_reaches_the_preset(speed, choice, expected, monkeypatch, flashinfer_stand_in):
    import argparse

    from diffusers_h3 import cli
    from diffusers_h3.attention_processors import flashinfer as flashinfer_processors
    from diffusers_h3.pipelines import speed_presets
    from diffusers_h3.testing.tiny import tiny_pipeline

    for module in (speed_presets, flashinfer_processors):  # the CPU poses as a Hopper GPU
        monkeypatch.setattr(module, "cuda_capability", lambda device=None: (9, 0))
    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    pipe.transformer.to(torch.bfloat16)  # FlashInfer runs bf16 / fp16 models only
    args = argparse.Namespace(lora=None, v100=False, vsa=None, attention_precision=None, cache=None, speed=speed,
                              flashinfer=choice, compile=False)  # fmt: skip
    cli._apply_fast_paths(pipe, args)
    attention = pipe._h3_speed_preset.describe()["attention"]["transformer"]
    assert expected in attention
    # exact: FlashInfer unless off; fast: FA3 FP8 only when on (automatic names it as the faster, less exact option).
    assert attention.startswith("dense bfloat16, FlashInfer") == (speed == "exact" and choice != "off")
    assert ("FP8 (single_prefill)" in attention) == (speed == "fast" and choice == "on")


def test_cli_fast_presets_load_the_text_encoder_quantized(tmp_path, monkeypatch):
    """--speed fast / fastest quantize the text encoder while loading (W8A16, the preset's format): on an 80 GB GPU
    the bf16 text encoder must never sit next to the DiT; without --speed it loads as stored."""
    from diffusers_h3 import cli
    from diffusers_h3.quantizers import is_quantized_linear

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parser = cli.build_parser()

    def text_encoder_methods(*flags):
        args = parser.parse_args(["generate", "--prompt", "a cat", "--out", str(tmp_path / "o.mp4"), "--device", "cpu",
                                  *flags])  # fmt: skip
        pipe = cli._load_pipeline(args)
        return {m.weight.quant_method for m in pipe.text_encoder.modules() if is_quantized_linear(m)}

    assert text_encoder_methods("--speed", "fastest") == {"h3_w8a16"}
    assert text_encoder_methods() == set()
    assert text_encoder_methods("--speed", "fast", "--quantize-text-encoder", "nvfp4") == {"h3_nvfp4"}
