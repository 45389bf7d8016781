"""The kernels one decode step launches, counted without a GPU: the DeepSeek-V4-Flash preset's
structure (its 4-layer pattern SWA, CSA, HCA, CSA, the first layer hash-routed, mHC with 4
streams) at small widths, run on the CPU with the CUDA path's Triton kernels in Triton's
interpreter (DEEPINFER_KERNEL_BACKEND=triton). One decode step at B requests is counted after
a warm-up: every Triton kernel launch by name, and every torch operator that would be a device
kernel on a GPU (views, shape queries and empty allocations left out), by name, per layer.

What a GPU step adds or removes is not counted: side-stream fork/join events, PDL, the graph's
input copies, and branches taken only on CUDA (those are listed where known). The count is a
map of where launches come from, for fusing; the device's own profile (``bench decode
--profile``) gives the times.

    PYTHONPATH=. python scripts/probes/decode_launches.py [--batch-size 1] [--weights fp8+fp4|bf16]
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["DEEPINFER_KERNEL_BACKEND"] = "triton"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from deepinfer.bench.model_shapes import resolve_config  # noqa: E402
from deepinfer.entrypoints.llm import build_engine_config  # noqa: E402
from deepinfer.engine.engine import Engine  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

# The preset at small widths; every structural field (layer pattern, compress rates, mHC,
# o_groups, top-k, hash routing, shared expert) as the preset has it.
SMALL = {"vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 8,
         "head_dim": 128, "partial_rotary_factor": 0.5, "q_lora_rank": 128, "o_lora_rank": 64,
         "n_routed_experts": 16, "index_n_heads": 8, "index_head_dim": 128, "index_topk": 16,
         "sliding_window": 16, "compress_rates": {"compressed_sparse_attention": 4,
                                                   "heavily_compressed_attention": 16}}
WEIGHTS = {"bf16": "none", "fp8+fp4": "fp8+mxfp4-experts"}
# aten operators that launch nothing on a GPU.
FREE = ("empty", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "reshape",
        "as_strided", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "select", "slice",
        "split", "split_with_sizes", "unbind", "chunk", "alias", "detach", "lift_fresh", "_reshape_alias",
        "sym_size", "sym_stride", "sym_numel", "is_same_size", "result_type", "unflatten", "flatten",
        "narrow", "view_as_real", "view_as_complex", "diagonal", "movedim", "squeeze_", "unsqueeze_",
        "set_", "item", "_local_scalar_dense", "is_nonzero", "empty_like", "_record_function_enter_new",
        "_record_function_exit")


class Counter(TorchDispatchMode):
    """Counts torch operators by name while ``on``; ``layer`` names where they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.layer = "outside layers"
        self.ops: collections.Counter = collections.Counter()
        self.by_layer: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()      # (layer, kernel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.on and name not in FREE and not getattr(func, "is_view", False):
            self.ops[f"torch {name}"] += 1
            self.by_layer[self.layer] += 1
            self.where[(self.layer, f"torch {name}")] += 1
        return out


def count_triton(counter: Counter) -> None:
    """Counts Triton launches (the interpreter's) into ``counter`` under their kernel names."""
    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if counter.on:
            counter.ops[f"triton {self.fn.__name__}"] += 1
            counter.by_layer[counter.layer] += 1
            counter.where[(counter.layer, f"triton {self.fn.__name__}")] += 1
        with _paused(counter):
            return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted


class _paused:
    """The interpreter's own torch calls are not launches: stop counting inside it."""

    def __init__(self, counter: Counter) -> None:
        self.counter, self.was = counter, counter.on

    def __enter__(self):
        self.was, self.counter.on = self.counter.on, False

    def __exit__(self, *exc):
        self.counter.on = self.was


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=40)
    parser.add_argument("--weights", choices=sorted(WEIGHTS), default="fp8+fp4")
    args = parser.parse_args()
    label, hf = resolve_config("deepseek-v4-flash", 4)
    hf = {**copy.deepcopy(hf), **SMALL}
    if args.weights == "fp8+fp4":
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    config = build_engine_config(label, hf_config=hf, load_format="dummy", skip_tokenizer_init=True,
                                 quantization=WEIGHTS[args.weights], dtype="float32", device="cpu",
                                 enforce_eager=True, max_model_len=256, max_num_seqs=args.batch_size)
    engine = Engine(config)
    model = engine.model
    counter = Counter()
    count_triton(counter)
    for name, layer in model.named_modules():
        if name.count(".") == 2 and name.startswith("model.layers."):
            layer.register_forward_pre_hook(lambda _m, _a, n=name: setattr(counter, "layer", n))
            layer.register_forward_hook(lambda _m, _a, _o: setattr(counter, "layer", "outside layers"))
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch_size):
        prompt = torch.randint(3, hf["vocab_size"], (args.context_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not all(len(r.output_token_ids) >= 2 for r in engine.scheduler.running):
        engine.step()
    with counter:
        counter.on = True
        engine.step()
        counter.on = False
    total = sum(counter.ops.values())
    print(f"# {label} at small widths, {args.weights}, B={args.batch_size}, context {args.context_len}: "
          f"{total} launches in one decode step")
    for name, n in sorted(counter.by_layer.items()):
        print(f"{n:5d}  {name}")
    print("# by kernel")
    for name, n in counter.ops.most_common():
        print(f"{n:5d}  {name}")
    print("# by layer and kernel")
    for (layer, name), n in sorted(counter.where.items()):
        print(f"{n:5d}  {layer:16s} {name}")


if __name__ == "__main__":
    main()
