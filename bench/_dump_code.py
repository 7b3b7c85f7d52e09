import os, sys, torch
from transformers import AutoModelForCausalLM
from kvpop.engine import DecodeEngine
from kvpop.modeling import tiny_config
from kvpop.policies import make_policy
torch.manual_seed(0)
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
pol = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8).cuda()
eng = DecodeEngine(m, pol, budget=4+16+12+128, sinks=4, window=16, batch_size=1, chunk=128)
eng.prefill(torch.randint(0, 96, (1, 200), device="cuda"))
for _ in range(3): eng.step()
torch.cuda.synchronize(); print("ok")
