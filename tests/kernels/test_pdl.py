"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that chains of
kernels launched with it compute exactly what plain launches compute, and that every
launch in deepinfer/kernels keeps its contract."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import deepinfer.kernels as kernels_pkg
from deepinfer.kernels import pdl
from deepinfer.kernels.fused_moe import fused_moe
from deepinfer.kernels.moe_routing import topk_route
from deepinfer.kernels.rms_norm import rms_norm

from .conftest import capture


def test_off_on_the_cpu():
    assert pdl.flags(torch.device("cpu")) == {"PDL": False}


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    # Decided before any CUDA query, so this holds on a machine without a GPU.
    assert pdl.flags(torch.device("cuda")) == {"PDL": False}


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PDL", "yes")
    with pytest.raises(ValueError, match="DEEPINFER_PDL='yes'"):
        pdl.flags(torch.device("cuda"))


def _chain(x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           router: torch.Tensor) -> torch.Tensor:
    # Each kernel reads what the one before it wrote: a missing wait shows up as a
    # different (stale) result.
    for _ in range(4):
        x = rms_norm(x, w, 1e-6)
        weights, ids = topk_route(x.float() @ router, 2, "sqrtsoftplus", 1.0, True, None)
        x = x + fused_moe(x, gate_up, down, weights, ids, 10.0)
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chain_in_a_cuda_graph_equals_plain_launches(monkeypatch):
    if not pdl.flags(torch.device("cuda")).get("PDL"):
        pytest.fail("PDL is off on this device (needs sm_90+); this test checks it on")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(3, 256, device=dev, dtype=bf, generator=g)
    w = torch.rand(256, device=dev, dtype=bf, generator=g) + 0.5
    gate_up = torch.randn(8, 2 * 128, 256, device=dev, dtype=bf, generator=g) / 16
    down = torch.randn(8, 256, 128, device=dev, dtype=bf, generator=g) / 11
    router = torch.randn(256, 8, device=dev, generator=g)

    monkeypatch.setenv("DEEPINFER_PDL", "0")
    plain = _chain(x, w, gate_up, down, router)
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    eager = _chain(x, w, gate_up, down, router)
    graph, out = capture(lambda: _chain(x, w, gate_up, down, router))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    torch.testing.assert_close(eager, plain, rtol=0, atol=0)


def _kernels_and_launches() -> tuple[dict[tuple[str, str], ast.FunctionDef], list[tuple[str, str, ast.Call]]]:
    """The @triton.jit functions of deepinfer/kernels by (file, name), and every ``*_kernel[grid](...)``
    launch of one there (Gluon kernels, ``@gluon.jit``, are left out: see the test below)."""
    defs, launches = {}, []
    for path in sorted(Path(kernels_pkg.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        gluon_kernels = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                         and any(ast.unparse(d).startswith("gluon.jit") for d in node.decorator_list)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                defs[(path.name, node.name)] = node
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")
                    and node.func.value.id not in gluon_kernels):
                launches.append((path.name, node.func.value.id, node))
    return defs, launches


def test_every_launched_kernel_keeps_the_pdl_contract():
    """A kernel launched with PDL but without the wait would race its predecessor: every
    launch passes ``**pdl.flags(...)``, and its kernel takes ``PDL`` last and calls
    ``pdl.enter(PDL)`` first (after its docstring)."""
    defs, launches = _kernels_and_launches()
    assert len(launches) >= 20
    for file, name, call in launches:
        assert any(k.arg is None and ast.unparse(k.value).startswith("pdl.flags(") for k in call.keywords), \
            f"{file}: {name} is launched without **pdl.flags(...)"
        kernel = defs[(file, name)]
        assert kernel.args.args[-1].arg == "PDL", f"{file}: {name} does not take PDL as its last parameter"
        body = kernel.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        assert ast.unparse(body[0]) == "pdl.enter(PDL)", f"{file}: {name} does not start with pdl.enter(PDL)"


def test_gluon_kernels_launch_plainly():
    """Gluon (triton 3.6) has no griddepcontrol, so a Gluon kernel cannot wait inside: it must
    be launched without the PDL attribute, which orders it after the previous kernel as any
    plain launch is (the next kernel, launched with PDL, waits for it in turn)."""
    found = 0
    for path in sorted(Path(kernels_pkg.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        gluon_kernels = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                         and any(ast.unparse(d).startswith("gluon.jit") for d in node.decorator_list)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in gluon_kernels):
                found += 1
                assert not any(k.arg in (None, "launch_pdl") for k in node.keywords), \
                    f"{path.name}: {node.func.value.id} must be launched without PDL"
    assert found >= 1
