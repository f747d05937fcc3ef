"""The embedded demo checkpoint: what the Python API gets from it is what the CLI runs (its 64x96 canvas)."""

import PIL.Image

from diffusers_h3 import MiniMaxH3Pipeline, cli
from diffusers_h3.pipelines.request import H3Request, RequestConfig
from diffusers_h3.testing import tiny


def test_demo_checkpoint_defaults_to_the_demo_canvas(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tiny.demo_checkpoint_dir()
    assert folder == tmp_path / "diffusers_h3" / f"tiny-demo-v{tiny.DEMO_CHECKPOINT_VERSION}"  # a new version rebuilds
    pipe = MiniMaxH3Pipeline.from_pretrained(folder)
    config = pipe.request_config()
    assert (config.canvas_short_edge, config.canvas_max_pixels) == (64, 64 * 96)
    t2va = H3Request.build(config, prompt="a cat")
    fl2va = H3Request.build(config, prompt="a cat", image=PIL.Image.new("RGB", (640, 360)))  # a 16:9 keyframe
    assert (t2va.height, t2va.width) == (fl2va.height, fl2va.width) == cli.DEMO_CANVAS == (64, 96)
    # The CLI checks demo requests on the same rule, from configs alone.
    from_configs = RequestConfig.from_configs(tiny.TINY_VAE_CONFIG, {"transformer": tiny.TINY_TRANSFORMER_CONFIG},
                                              tiny.DEMO_PIPELINE_CONFIG)  # fmt: skip
    assert from_configs.canvas_rule == RequestConfig.from_folder(folder, partitions=("transformer",)).canvas_rule
