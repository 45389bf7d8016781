"""Does a prefill forward make the host wait for the device? On CUDA such a wait in the
middle of step N+1's launches would let the GPU run dry after step N (overlapped scheduling
hides host work only while the host stays ahead).

Runs the embedded DeepSeek-V4 model on the CPU with the Triton kernels (interpreter) and
counts, inside the model's forward, every op that would synchronise on CUDA (``.item()``,
``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without a size,
``tolist``), with the deepinfer frames that called it. About 35 s:

    PYTHONPATH=. python scripts/probes/prefill_sync_check.py [prompt_len]

2026-12-04: none in a 600- or 64-token prefill (7,456 ops seen at 64 tokens).
"""
from __future__ import annotations

import collections
import os
import sys
import traceback

os.environ["DEEPINFER_KERNEL_BACKEND"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from deepinfer.entrypoints.llm import LLM  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
           aten.equal.default}
MASK_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default}
hits: collections.Counter = collections.Counter()
ops_seen = [0]


def caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/deepinfer/" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames[-4:]))


class Syncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ops_seen[0] += 1
        syncs = func in SYNCING or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None)
        if func in MASK_INDEXING:
            syncs |= any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        if syncs:
            hits[(str(func), caller())] += 1
        return func(*args, **kwargs)


def main(prompt_len: int) -> None:
    llm = LLM(device="cpu")
    model = llm.engine.runner.model
    forward, tolist, inside = model.forward, torch.Tensor.tolist, [False]

    def counted_tolist(self):
        if inside[0]:
            hits[("Tensor.tolist", caller())] += 1
        return tolist(self)

    def checked_forward(*args, **kwargs):
        inside[0] = True
        try:
            with Syncs():
                return forward(*args, **kwargs)
        finally:
            inside[0] = False

    model.forward = checked_forward
    torch.Tensor.tolist = counted_tolist
    ids = torch.randint(0, 1000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    print(f"{ops_seen[0]} ops inside the forward; {sum(hits.values())} would synchronise on CUDA")
    for (op, where), n in hits.most_common():
        print(f"  {n:4d} {op}  {where}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
