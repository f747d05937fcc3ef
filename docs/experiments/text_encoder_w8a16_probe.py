"""How far weight-only INT8 moves a random-weight Qwen3 stack compared with bf16 rounding alone (CPU).

    python docs/experiments/text_encoder_w8a16_probe.py

Results and what they mean: docs/experiments/text_encoder_w8a16_cpu.md."""

import copy

import torch
from transformers import Qwen3Config, Qwen3Model

import diffusers_h3


torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=1000, hidden_size=1024, intermediate_size=5120, num_hidden_layers=50, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, max_position_embeddings=1024)
m = Qwen3Model(cfg).eval()
ids = torch.randint(0, 1000, (1, 256))
def hs(model, dtype):
    with torch.no_grad():
        return model.to(dtype)(input_ids=ids, output_hidden_states=True).hidden_states[50].float()
ref32 = hs(m, torch.float32)
b16 = hs(m, torch.bfloat16)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


print("bf16 vs fp32", rel(b16, ref32))
q = copy.deepcopy(m).to(torch.bfloat16)
diffusers_h3.quantize(q, diffusers_h3.W8A16Config())
w8 = hs(q, torch.bfloat16)
print("w8a16 vs bf16", rel(w8, b16), "w8a16 vs fp32", rel(w8, ref32))
for L in (1, 5, 10, 25):
    with torch.no_grad():
        a = m.to(torch.bfloat16)(input_ids=ids, output_hidden_states=True).hidden_states[L].float()
        b = q(input_ids=ids, output_hidden_states=True).hidden_states[L].float()
    print("layer", L, "w8a16 vs bf16", rel(b, a))
