"""A new attention processor is its own file plus one registration: a processor registered here, in the test file,
installs, reports and uninstalls through the shared functions, with nothing else written for it."""

from dataclasses import dataclass

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

from diffusers_h3 import describe
from diffusers_h3._hooks import H3_CALL_PLAN_HOOK, get_h3_hook
from diffusers_h3.attention_processors import (
    LowPrecisionAttentionConfig,
    MiniMaxH3AttnProcessorBase,
    PlanForInputs,
    attention_processor_state,
    disable_attention_processor,
    enable_attention_processor,
    register_attention_processor,
)
from diffusers_h3.attention_processors.install import processor_entry_points
from diffusers_h3.kernels.attention import KernelChoice
from diffusers_h3.testing.tiny import tiny_pipeline, tiny_transformer, tiny_transformer_inputs


@dataclass(frozen=True)
class ScaledConfig:
    temperature: float = 1.0

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@register_attention_processor("scaled_attention", ScaledConfig)
class ScaledProcessor(MiniMaxH3AttnProcessorBase):
    """Softmax attention with the logits divided by a temperature (1: diffusers' attention)."""

    def __init__(self, config: ScaledConfig):
        super().__init__()
        self.config = config

    plans_read_layout = False  # dense: the plan does not depend on the call's layout

    def plan_call(self, call):
        kernel = KernelChoice("torch-sdpa", "dense", f"temperature {self.config.temperature}")
        return PlanForInputs(kernel, call.device, call.dtype, call.head_dim)

    def core(self, query, key, value, attention_mask=None, **extras):
        self.current_plan(query)  # planned once per transformer call by the hook; describe_path reports its kernel
        scale = query.shape[-1] ** -0.5 / self.config.temperature
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attention_mask, scale=scale
        )
        return out.transpose(1, 2)


enable_scaled_attention, disable_scaled_attention, scaled_attention_state = processor_entry_points(ScaledProcessor)


def _run(model):
    with torch.no_grad():
        return model(**tiny_transformer_inputs(seed=2), return_dict=False)[0]


def test_a_processor_registered_in_one_file_installs_reports_and_uninstalls():
    torch.manual_seed(0)
    model = tiny_transformer()
    reference = _run(model)
    assert attention_processor_state(model, ScaledConfig) is None

    assert enable_attention_processor(model, ScaledConfig()) is model
    blocks = model.transformer_blocks
    assert all(type(b.attn.processor) is ScaledProcessor for b in blocks)
    assert get_h3_hook(model, H3_CALL_PLAN_HOOK) is not None
    torch.testing.assert_close(_run(model), reference, rtol=1e-5, atol=1e-6)  # temperature 1: the same attention
    state = attention_processor_state(model, ScaledConfig)
    assert state["blocks"] == len(blocks) and state["temperature"] == 1.0
    assert state["path"] == "ScaledProcessor: torch-sdpa kernel (dense; temperature 1.0)"
    assert describe(model)["model"]["attention"][state["path"]] == len(blocks)

    enable_scaled_attention(model, ScaledConfig(temperature=4.0))  # the named entry points, derived from the class
    assert not torch.allclose(_run(model), reference)
    assert scaled_attention_state(model)["temperature"] == 4.0
    with pytest.warns(FutureWarning, match=r"enable_scaled_attention\(target, ScaledConfig\(temperature=2.0\)\)"):
        enable_scaled_attention(model, temperature=2.0)
    assert scaled_attention_state(model)["temperature"] == 2.0
    assert enable_scaled_attention.__name__ == "enable_scaled_attention" and "ScaledProcessor" in enable_scaled_attention.__doc__

    assert disable_scaled_attention(model) is model
    assert all(type(b.attn.processor) is MiniMaxH3AttnProcessor for b in blocks)
    assert get_h3_hook(model, H3_CALL_PLAN_HOOK) is None and scaled_attention_state(model) is None
    torch.testing.assert_close(_run(model), reference, rtol=0, atol=0)


def test_the_registry_checks_before_anything_changes():
    pipe = tiny_pipeline(seed=1, with_transformer_ref=False)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        enable_attention_processor(pipe, ScaledConfig(temperature=0.0))
    with pytest.raises(TypeError, match="not the config of a registered attention processor"):
        enable_attention_processor(pipe, object())
    with pytest.raises(TypeError, match="enable_scaled_attention expects a MiniMaxH3Transformer3DModel"):
        enable_scaled_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already the config of ScaledProcessor"):
        register_attention_processor("other", ScaledConfig)(type("Other", (MiniMaxH3AttnProcessorBase,), {}))
    enable_attention_processor(pipe, LowPrecisionAttentionConfig("fp8"))  # a pipeline: its partition(s)
    assert attention_processor_state(pipe.transformer, LowPrecisionAttentionConfig)["precision"] == "fp8"
    assert disable_attention_processor(pipe) is pipe
    assert attention_processor_state(pipe.transformer, LowPrecisionAttentionConfig) is None
