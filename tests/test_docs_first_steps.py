"""What a new user reads first still works as written: the README's two commands with the CPU-only install beside
them, and the demo checkpoint's Python path in docs/getting_started.md."""

import re
from pathlib import Path

import torch

from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.testing import tiny


ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _blocks(text, language):
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_readme_starts_with_the_two_commands_and_the_cpu_install_beside_them():
    readme = (ROOT / "README.md").read_text()
    commands = _blocks(readme, "bash")[0].strip().splitlines()
    assert commands == [
        'pip install -e ".[test]" && diffusers-h3 generate --prompt "A street drummer plays under neon lights" --out clip.mp4',
        "python -m pytest -q",
    ]
    after = " ".join(readme.split("```", 2)[2].split("\n\n", 2)[1].split())  # the paragraph right after the block
    assert f"pip install torch torchvision {CPU_INDEX}" in after and "before the first line" in after, after
    assert f"pip install torch torchvision {CPU_INDEX}" in (ROOT / "docs" / "getting_started.md").read_text()


def test_getting_started_demo_snippet_runs_at_the_demo_size(tmp_path, monkeypatch):
    guide = (ROOT / "docs" / "getting_started.md").read_text()
    assert f"~/.cache/diffusers_h3/tiny-demo-v{tiny.DEMO_CHECKPOINT_VERSION}" in guide
    snippet = next(block for block in _blocks(guide, "python") if "demo_checkpoint_dir()" in block)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # As written, but the latents are returned instead of decoded (the decode is tested elsewhere): they show the canvas.
    call = MiniMaxH3Pipeline.__call__
    monkeypatch.setattr(MiniMaxH3Pipeline, "__call__", lambda self, **kwargs: call(self, **kwargs, output_type="latent"))
    namespace = {}
    with torch.random.fork_rng(devices=[]):
        exec(snippet, namespace)
    latents = namespace["out"].frames  # (1, C, latent frames, height / 16, width / 16)
    assert latents.shape[2:] == (37, 64 // 16, 96 // 16), latents.shape  # 124 frames at 64x96, not 768x1344
