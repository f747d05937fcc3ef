"""benchmarks/request.py's ``random_init_on``: the random inits of modules built on the CPU run on another device's
RNG and are copied back. On the CPU the replay tensor is told apart from the module's by identity: spies installed
before the context becomes the functions it wraps, so they see which tensor each init actually filled."""

import functools
import importlib.util
import inspect
import math
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "request.py"
CPU = torch.device("cpu")


@pytest.fixture
def request_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmarks_request", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports _common from its folder
    spec.loader.exec_module(module)
    return module


def spy(init, calls):
    """``init`` recording (tensor filled, its other arguments by name, as passed) per call."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def recorded(tensor, *args, **kwargs):
        arguments = dict(signature.bind(tensor, *args, **kwargs).arguments)
        calls.append((arguments.pop("tensor"), arguments))
        return init(tensor, *args, **kwargs)

    return recorded


def test_linear_kaiming_init_is_replayed_and_copied_back(request_module, monkeypatch):
    calls = []
    kaiming = spy(torch.nn.init.kaiming_uniform_, calls)
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", kaiming)
    with request_module.random_init_on(CPU):
        linear = torch.nn.Linear(1024, 512)  # 524,288 weight elements: replayed
    weight = linear.weight.detach()
    filled = [t for t, _ in calls if t.shape == weight.shape]
    assert len(filled) == 1, "nn.Linear's kaiming_uniform_ did not go through the context's wrapper"
    replay = filled[0]
    assert replay is not linear.weight and replay.data_ptr() != weight.data_ptr()  # a separate tensor was filled...
    assert replay.dtype == weight.dtype and torch.equal(replay, weight)  # ...and copied into the CPU weight
    assert weight.device == CPU and isinstance(linear.weight, torch.nn.Parameter) and linear.weight.requires_grad
    bound = 1 / math.sqrt(1024)  # kaiming_uniform_(a=sqrt(5)) on fan_in 1024, as nn.Linear asks for
    assert weight.abs().max() <= bound and weight.unique().numel() > 1000
    assert weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    assert torch.nn.init.kaiming_uniform_ is kaiming  # restored to what was there before


def test_transformers_init_table_is_routed(request_module, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers import initialization as hf_init

    if not isinstance(getattr(hf_init, "TORCH_INIT_FUNCTIONS", None), dict):
        pytest.skip("this transformers has no TORCH_INIT_FUNCTIONS table")
    calls = []
    normal = spy(hf_init.TORCH_INIT_FUNCTIONS["normal_"], calls)
    monkeypatch.setitem(hf_init.TORCH_INIT_FUNCTIONS, "normal_", normal)
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      tie_word_embeddings=False)  # fmt: skip
    with request_module.random_init_on(CPU):
        model = transformers.Qwen3ForCausalLM(config)  # _init_weights: init.normal_ -> TORCH_INIT_FUNCTIONS
    embed = model.model.embed_tokens.weight.detach()  # 131,072 elements: replayed
    replays = [t for t, _ in calls if t.shape == embed.shape]
    assert replays, "transformers' init.normal_ did not reach the context's wrapper"
    assert all(t.data_ptr() not in (embed.data_ptr(), model.lm_head.weight.data_ptr()) for t in replays)
    assert any(torch.equal(t, embed) for t in replays)
    assert embed.std().item() == pytest.approx(config.initializer_range, rel=0.05) and embed.unique().numel() > 1000
    assert hf_init.TORCH_INIT_FUNCTIONS["normal_"] is normal

    # transformers' own wrapper called directly, on a bf16 tensor
    calls.clear()
    big = torch.empty(256, 512, dtype=torch.bfloat16)
    with request_module.random_init_on(CPU):
        assert hf_init.normal_(big, mean=1.0, std=0.5) is big
    assert len(calls) == 1 and calls[0][0] is not big and calls[0][0].dtype == torch.bfloat16
    assert calls[0][1]["mean"] == 1.0 and calls[0][1]["std"] == 0.5
    assert big.float().mean().item() == pytest.approx(1.0, abs=0.01)


def test_everything_is_restored_on_exit_and_on_an_exception(request_module):
    from transformers import initialization as hf_init

    names = request_module.RANDOM_INIT_FUNCTIONS
    before = {name: getattr(torch.nn.init, name) for name in names}
    table_before = dict(hf_init.TORCH_INIT_FUNCTIONS)
    deterministic = {name: getattr(torch.nn.init, name) for name in ("zeros_", "ones_", "constant_", "eye_")}
    with request_module.random_init_on(CPU):
        assert all(getattr(torch.nn.init, name) is not before[name] for name in names)
        assert all(hf_init.TORCH_INIT_FUNCTIONS[name] is not table_before[name] for name in names)
        assert all(getattr(torch.nn.init, name) is fn for name, fn in deterministic.items())  # never touched
    assert all(getattr(torch.nn.init, name) is before[name] for name in names)
    assert hf_init.TORCH_INIT_FUNCTIONS == table_before
    with pytest.raises(RuntimeError, match="inside the context"):
        with request_module.random_init_on(CPU):
            raise RuntimeError("inside the context")
    assert all(getattr(torch.nn.init, name) is before[name] for name in names)
    assert all(hf_init.TORCH_INIT_FUNCTIONS[name] is fn for name, fn in table_before.items())


def test_a_generator_argument_is_dropped_for_the_replay(request_module, monkeypatch):
    calls = []
    for name in ("normal_", "uniform_"):
        monkeypatch.setattr(torch.nn.init, name, spy(getattr(torch.nn.init, name), calls))
    big = torch.empty(1 << 17)
    with request_module.random_init_on(CPU):
        torch.nn.init.normal_(big, mean=0.0, std=2.0, generator=torch.Generator().manual_seed(0))
        assert calls[-1][0] is not big and "generator" not in calls[-1][1] and calls[-1][1]["std"] == 2.0
        assert big.std().item() == pytest.approx(2.0, rel=0.02)
        torch.nn.init.uniform_(big, -3.0, 3.0, torch.Generator().manual_seed(0))  # generator passed positionally
        assert calls[-1][0] is not big and "generator" not in calls[-1][1] and calls[-1][1]["a"] == -3.0
        assert -3.0 <= big.min() < -2.9 and 2.9 < big.max() <= 3.0
        # a small tensor stays on the CPU with its generator (reproducible); a non-CPU tensor is not replayed
        small = [torch.empty(100) for _ in range(2)]
        for tensor in small:
            torch.nn.init.normal_(tensor, generator=torch.Generator().manual_seed(1))
            assert calls[-1][0] is tensor and "generator" in calls[-1][1]
        assert torch.equal(small[0], small[1])
        meta = torch.empty(1 << 17, device="meta")
        torch.nn.init.normal_(meta)
        assert calls[-1][0] is meta
