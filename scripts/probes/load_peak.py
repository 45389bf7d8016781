"""Peak memory while loading a checkpoint in DeepSeek-V4.1's release formats with its formats kept
(``quantization="fp8+mxfp4-experts"``): the shipped bytes loaded straight into the quantised
layers (``load_model``) against the path before, which built the 16-bit model, dequantised every
shipped tensor into it and quantised it again (``tests/unit/test_load_shipped.load_requantised``).

The checkpoint is the tiny V4.1 reference (tests/data/v41_reference) with wider routed experts:
``--experts`` per layer of intermediate size ``--intermediate`` (random packed FP4 codes and UE8M0
scales, random router), so that the experts dominate its bytes. Each path loads in a fresh
process; the figure is, on CUDA, ``torch.cuda.max_memory_allocated`` during the load, on the CPU
the peak resident set (``ru_maxrss``) less the resident set before the load (torch imported and
warmed up; the untouched pages of ``torch.empty`` do not count, pages mapped from the checkpoint
file do). Writes ``load_peak.json`` to ``--out`` and prints it.

Run (repo root):  python scripts/probes/load_peak.py --device cuda --out $OUT
                  python scripts/probes/load_peak.py --device cpu --experts 128 --intermediate 256
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "data" / "v41_reference" / "checkpoint"


def write_wide_experts(out: Path, experts: int, intermediate: int, seed: int = 0) -> Path:
    """The reference checkpoint with ``experts`` routed experts of width ``intermediate`` per layer,
    and shared experts of that width (the MTP drafter's own unchanged)."""
    from safetensors.torch import load_file, save_file
    out.mkdir(parents=True)
    for f in REFERENCE.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((REFERENCE / "config.json").read_text())
    text = config["text_config"]
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    text["n_routed_experts"], text["moe_intermediate_size"] = experts, intermediate
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v for k, v in load_file(REFERENCE / "model.safetensors").items()
               if not (k.startswith("layers.") and ".ffn." in k)}

    def fp4(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8)
        scales = torch.randint(118, 124, (rows, cols // 32), generator=g, dtype=torch.uint8)
        return codes, scales.view(torch.float8_e8m0fnu)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randn(rows, cols, generator=g).mul(64).to(torch.float8_e4m3fn)
        scales = torch.randint(118, 124, (rows // 32, cols // 32), generator=g, dtype=torch.uint8)
        return codes, scales.view(torch.float8_e8m0fnu)

    for i in range(layers):
        for proj, (rows, cols) in (("w1", (intermediate, hidden)), ("w3", (intermediate, hidden)),
                                   ("w2", (hidden, intermediate))):
            name = f"layers.{i}.ffn.shared_experts.{proj}"
            tensors[name + ".weight"], tensors[name + ".scale"] = fp8(rows, cols)
        tensors[f"layers.{i}.ffn.gate.weight"] = torch.randn(experts, hidden, generator=g).bfloat16()
        tensors[f"layers.{i}.ffn.gate.bias"] = torch.zeros(experts)
        for e in range(experts):
            for proj, (rows, cols) in (("w1", (intermediate, hidden)), ("w3", (intermediate, hidden)),
                                       ("w2", (hidden, intermediate))):
                name = f"layers.{i}.ffn.experts.{e}.{proj}"
                tensors[name + ".weight"], tensors[name + ".scale"] = fp4(rows, cols)
    save_file(tensors, out / "model.safetensors")
    return out


def measure(path: str, mode: str, device: str, dtype: str) -> dict:
    """One load in this process: the peak it added, and the weights' bytes after it."""
    sys.path.insert(0, str(ROOT))
    from deepinfer.config import ModelConfig
    from deepinfer.models.loader import load_model
    dev = torch.device(device)
    torch.ones(1, device=dev).sum().item()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    if mode == "direct":
        model = load_model(ModelConfig.from_path(path, dtype, None, dev, quantization="fp8+mxfp4-experts"), dev)
    else:
        from tests.unit.test_load_shipped import load_requantised
        model = load_requantised(Path(path), dtype, dev)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    from deepinfer.models.quantize import weight_bytes
    return {"mode": mode, "peak_bytes": peak, "weight_bytes": weight_bytes(model),
            "shipped_tensors": len(model.shipped_tensors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--out", default=".")
    parser.add_argument("--measure", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.device, args.dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = write_wide_experts(Path(tmp) / "ckpt", args.experts, args.intermediate)
        file_bytes = (path / "model.safetensors").stat().st_size
        runs = []
        for mode in ("direct", "requantised"):
            done = subprocess.run([sys.executable, __file__, "--device", args.device, "--dtype", args.dtype,
                                   "--measure", str(path), mode], capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                sys.exit(f"{mode} load failed:\n{done.stderr[-4000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"device": args.device, "dtype": args.dtype, "experts": args.experts,
              "intermediate": args.intermediate, "checkpoint_bytes": file_bytes, "runs": runs}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "load_peak.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
