"""diffusers' logging switches govern the plugin: `diffusers.utils.logging.set_verbosity_*` reaches our loggers (named
`diffusers_h3.*`), and the loading and denoising progress bars follow diffusers' switches."""

import contextlib
import importlib
import io
import logging as std_logging
import pkgutil

import pytest
import torch
from diffusers.utils import logging

import diffusers_h3
from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.loaders.lora_presets import LoraDistillationPreset, warn_schedule_differences
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_NUM_FRAMES, save_hub_layout, tiny_components


@pytest.fixture
def verbosity():
    level = logging.get_verbosity()
    yield
    logging.set_verbosity(level)


@pytest.fixture
def progress_bars():
    enabled = logging.is_progress_bar_enabled()
    yield
    (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()


@contextlib.contextmanager
def _shown_by_diffusers():
    """What reaches the handlers of diffusers' library root logger (where diffusers' own default handler sits)."""
    stream = io.StringIO()
    handler = std_logging.StreamHandler(stream)
    root = logging.get_logger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


def _warn_schedule():
    preset = LoraDistillationPreset(name="turbo", num_inference_steps=9)
    warn_schedule_differences("turbo", preset, ["num_inference_steps=50 (trained: 9)"])


def test_set_verbosity_governs_our_warnings(verbosity):
    # Captured at diffusers' library root: our records must reach diffusers' handler, at diffusers' level.
    with _shown_by_diffusers() as shown:
        logging.set_verbosity_error()
        _warn_schedule()
    assert shown.getvalue() == ""
    with _shown_by_diffusers() as shown:
        logging.set_verbosity_info()
        _warn_schedule()
    assert "num_inference_steps=50 (trained: 9)" in shown.getvalue()


def _package_loggers():
    """Every module-level `logger` of the package."""
    loggers = {}
    for module in pkgutil.walk_packages(diffusers_h3.__path__, "diffusers_h3."):
        if module.name.startswith(("diffusers_h3.cli", "diffusers_h3.kernels.attention.csrc")):
            continue
        logger = getattr(importlib.import_module(module.name), "logger", None)
        if logger is not None:
            loggers[module.name] = logger
    return loggers


def test_every_package_logger_follows_diffusers_verbosity(verbosity):
    loggers = _package_loggers()
    assert {"diffusers_h3.loaders.lora", "diffusers_h3.pipelines.loading", "diffusers_h3._utils"} <= set(loggers)
    for level in (logging.ERROR, logging.INFO):
        logging.set_verbosity(level)
        assert {name: lg.getEffectiveLevel() for name, lg in loggers.items()} == dict.fromkeys(loggers, level)


# -- progress bars ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    components = tiny_components(seed=0, text_encoder_layers=2, with_transformer_ref=False)
    return save_hub_layout(components, tmp_path_factory.mktemp("hub"))


def test_loading_bar_follows_diffusers_switch(hub_folder, progress_bars, capsys):
    # The loading bar runs before the pipeline exists: diffusers' own switch for loading bars governs it.
    load = {"text_encoder": None, "tokenizer": None, "processor": None}
    logging.disable_progress_bar()
    MiniMaxH3Pipeline.from_pretrained(hub_folder, **load)
    assert "Loading MiniMax-H3 components" not in capsys.readouterr().err
    logging.enable_progress_bar()
    MiniMaxH3Pipeline.from_pretrained(hub_folder, **load)
    assert "Loading MiniMax-H3 components" in capsys.readouterr().err


def test_denoising_bar_follows_set_progress_bar_config(capsys):
    components = tiny_components(seed=0, text_encoder_layers=2, with_transformer_ref=False)
    pipe = MiniMaxH3Pipeline(**{**components, "text_encoder": None, "tokenizer": None, "processor": None},
                             **TINY_DURATION_LIMITS)
    call = {
        "prompt_embeds": torch.zeros(1, 3, pipe.transformer.config.text_dim),
        "text_token_tags": torch.ones(3, dtype=torch.long),
        "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent",
    }  # fmt: skip
    pipe(**call)
    assert "1/1" in capsys.readouterr().err
    pipe.set_progress_bar_config(disable=True)
    pipe(**call)
    assert "1/1" not in capsys.readouterr().err
