import os, time, copy
os.environ["TRITON_INTERPRET"] = "1"
import torch
from tests.models.test_deepseek_v4 import HF_STYLE, randomize, prompts, our_logits
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.kernels import hyper_connection as hc
cfg = dict(HF_STYLE, num_hidden_layers=2, layer_types=HF_STYLE["layer_types"][:2], mlp_layer_types=HF_STYLE["mlp_layer_types"][:2], hc_sinkhorn_iters=3)
m = DeepseekV4ForCausalLM(cfg, torch.float32).eval()
randomize(m, 0, cfg["n_routed_experts"], cfg["num_experts_per_tok"])
seqs = prompts([40, 13, 27], cfg["vocab_size"])
os.environ["DEEPINFER_KERNEL_BACKEND"] = "triton"
for thr in (10**9, 64):
    hc.FUSE_POST_MIN_T = thr
    t0 = time.time(); out = our_logits(m, seqs); print(thr, time.time() - t0)
    if thr == 10**9: ref = out
for a, b in zip(out, ref): print((a - b).abs().max().item(), a.abs().max().item())
