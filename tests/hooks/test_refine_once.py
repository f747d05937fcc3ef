"""The refiner-once hook answers from its cache only for the same input: a step callback that replaces the prompt
embeddings with others of the same shape gets the refiner run on them, bitwise as without the hook."""

import contextlib

import torch

from diffusers_h3.pipelines import pipeline_minimax_h3
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


RUN = {"prompt": "a fox in snow", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 4,
       "output_type": "latent", "callback_on_step_end_tensor_inputs": ["prompt_embeds"]}  # fmt: skip


def _replace_embeddings_after_the_first_step(pipe, step, timestep, tensors):
    if step == 0:  # same shape, other values (what a prompt-switching callback does)
        return {"prompt_embeds": torch.flip(tensors["prompt_embeds"], dims=[1]) * 0.5}
    return {}


def test_replaced_prompt_embeddings_are_refined_not_answered_from_the_cache(monkeypatch):
    pipe = tiny_pipeline(with_transformer_ref=False)
    refiner_runs = []
    probe = pipe.transformer.token_refiner.refiner_blocks[0].register_forward_hook(lambda *args: refiner_runs.append(1))

    def generate():
        return pipe(**RUN, callback_on_step_end=_replace_embeddings_after_the_first_step,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip

    cached = generate()
    runs_with_the_hook = len(refiner_runs)
    # The reference: the refiner runs at every step (no hook).
    monkeypatch.setattr(pipeline_minimax_h3, "refine_text_once", lambda transformer: contextlib.nullcontext())
    refiner_runs.clear()
    every_step = generate()
    probe.remove()
    assert len(refiner_runs) == 3 and runs_with_the_hook == 2  # 3 forwards: the first input, then the replaced one
    assert torch.equal(cached.frames, every_step.frames) and torch.equal(cached.audio, every_step.audio)
