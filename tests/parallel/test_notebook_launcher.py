"""`accelerate.notebook_launcher` runs `enable_context_parallel` as a notebook would: 2 forked CPU ranks (gloo).

The launch happens in a fresh interpreter (the notebook kernel), which has imported torch but computed nothing, so the
fork that Accelerate uses for CPU ranks is safe; rank 0's output must equal the one-process forward.
"""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ._tiny_cp import cp_inputs, cp_transformer, forward


ROOT = Path(__file__).resolve().parents[2]

KERNEL = textwrap.dedent(
    """
    import sys

    from accelerate import notebook_launcher


    def generate(out_path):
        import torch
        import torch.distributed as dist

        from diffusers_h3.parallel import enable_context_parallel
        from tests.parallel._tiny_cp import cp_inputs, cp_transformer, forward

        torch.set_num_threads(1)
        # No process group yet: enable_context_parallel creates it through Accelerate's PartialState; no config:
        # Ulysses over every rank of it.
        model = enable_context_parallel(cp_transformer())
        video, audio = forward(model, cp_inputs(5))
        if dist.get_rank() == 0:
            torch.save({"video": video, "audio": audio, "world": dist.get_world_size()}, out_path)


    notebook_launcher(generate, args=(sys.argv[1],), num_processes=2, use_port=sys.argv[2])
    """
)


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def test_notebook_launcher_runs_context_parallel_like_one_process(tmp_path):
    out = tmp_path / "rank0.pt"
    result = subprocess.run(
        [sys.executable, "-c", KERNEL, str(out), _free_port()],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = torch.load(out)
    expected_video, expected_audio = forward(cp_transformer(), cp_inputs(5))
    assert ranks["world"] == 2
    torch.testing.assert_close(ranks["video"], expected_video, atol=1e-5, rtol=0)
    torch.testing.assert_close(ranks["audio"], expected_audio, atol=1e-5, rtol=0)
