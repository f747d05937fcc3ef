"""Threads calling one pipeline (a web server's shape) get exactly the outputs of sequential calls, dense and with
video sparse attention: per-call state lives in the call (the text encoder's early exit, the packed layout), and
the denoising loop over the shared schedulers takes turns under `pipe.denoise_lock`."""

import threading

import pytest
import torch

from diffusers_h3.pipelines import pipeline_minimax_h3
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


RUN = {"height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}
REQUESTS = [("a fox in snow", 0), ("a drummer under neon lights", 1), ("rain on a window", 2), ("waves", 3)]


def _call(pipe, prompt, seed):
    return pipe(prompt=prompt, **RUN, generator=torch.Generator().manual_seed(seed))


def _concurrent(pipe, requests):
    barrier = threading.Barrier(len(requests))
    results, errors = [None] * len(requests), []

    def worker(index, prompt, seed):
        try:
            barrier.wait()
            results[index] = _call(pipe, prompt, seed)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, *request)) for i, request in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("attention", ["dense", "vsa"])
def test_threads_give_the_outputs_of_sequential_calls(attention):
    pipe = tiny_pipeline(seed=4)
    requests = REQUESTS
    if attention == "vsa":
        # The torch reference kernels (the interpreter is slow on CPU); three threads still interleave their calls.
        pipe.enable_vsa(sparsity=0.5, backend="torch")
        requests = REQUESTS[:3]
    sequential = [_call(pipe, *request) for request in requests]
    assert not torch.equal(sequential[0].frames, sequential[1].frames)
    concurrent = _concurrent(pipe, requests)
    for expected, out in zip(sequential, concurrent):
        assert torch.equal(out.frames, expected.frames) and torch.equal(out.audio, expected.audio)
    if attention == "vsa":
        processors = [block.attn.processor for block in pipe.transformer.transformer_blocks]
        assert any(p._last_sparse_kernel is not None for p in processors), "the sparse VSA path must have run"


def test_text_encoder_early_exit_is_per_call():
    """Four threads encode at once on one text encoder; each gets its own prompt's hidden state."""
    pipe = tiny_pipeline(seed=4)
    prompts = [prompt for prompt, _ in REQUESTS]
    token_ids = [pipe.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expected = [pipe.encode_presentation(ids) for ids in token_ids]
    barrier = threading.Barrier(len(prompts))
    results, errors = [None] * len(prompts), []

    def worker(index):
        try:
            barrier.wait()
            for _ in range(3):
                results[index] = pipe.encode_presentation(token_ids[index])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert all(torch.equal(out, ref) for out, ref in zip(results, expected))
    assert pipeline_minimax_h3._TEXT_ENCODER_CAPTURE.get() is None
