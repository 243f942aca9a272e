"""flash-linear-attention as a backend (``create(..., backend='fla')``, variants/fla_backend.py):
the variants it maps compute attnbench's function, against the float64 torch reference, forward
and every gradient (inputs, β, the log gate, ReBased's γ and β), through the parallel form, the
recurrent step and a prefill chain; the variants it does not map are refused naming the
difference. On a CPU fla's recurrent kernels run through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 there); on a GPU its chunk kernels run natively. Skipped where fla-core
is not installed (``pip install 'attnbench[fla]'``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import assert_close, check_forms, config_id, make_inputs, to

import variants
from harness.scenario import load_scenario

needs_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
    reason="flash-linear-attention is not installed (pip install 'attnbench[fla]', package fla-core)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32
#: The variants fla maps, with parameters that exercise each part of the mapping.
STATEFUL = [
    ("linear", {}),
    ("linear", {"phi": "identity", "normalize": False}),
    ("linear", {"phi": "dpfp", "nu": 1, "sum_norm": True}),
    ("performer", {"m": 4}),
    ("dpfp", {"nu": 1}),
    ("delta", {}),
    ("deltanet", {}),
    ("gated_delta", {}),
]
PARALLEL_ONLY = [("based", {}), ("based", {"normalize": False}), ("rebased", {}), ("rebased", {"normalize": False})]


def _pair(config, seed):
    """The fla core (its learnable parameters drawn at random) and the float64 torch core holding the same values."""
    name, params = config
    core = variants.create(name, 6, backend="fla", **params)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in core.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    reference = variants.create(name, 6, **params)
    reference.load_state_dict(core.state_dict())
    return core.to(DEVICE), reference.double()


def _on_device(inputs: dict, requires_grad=False) -> dict:
    return {name: x.detach().to(DEVICE, DTYPE).requires_grad_(requires_grad) for name, x in inputs.items()}


@pytest.mark.slow
@needs_fla
@pytest.mark.parametrize("config", STATEFUL, ids=config_id)
def test_fla_parallel_and_step_match_the_reference(config, seed):
    """The parallel form and the step loop, forward and every gradient (tests/helpers.check_forms)."""
    core, reference = _pair(config, seed)
    inputs = make_inputs(reference, 2, 3, 19, 5, dtype=torch.float64, seed=seed)
    if DEVICE == "cpu" and config[0] == "gated_delta":  # fla's recurrent gated kernel has no backward
        check_forms(core, reference, inputs, DTYPE, seed, f"{config_id(config)}[fla]", backward=False)
        with pytest.raises(variants.UnsupportedBackend, match="fused_recurrent_gated_delta_rule has no backward"):
            core(**to(inputs, DTYPE, requires_grad=True))
        return
    if DEVICE == "cpu":
        check_forms(core, reference, inputs, DTYPE, seed, f"{config_id(config)}[fla]")
        return
    if config[0] in ("delta", "deltanet"):
        with pytest.raises(variants.UnsupportedBackend, match="chunk_delta_rule refuses float32"):
            core(**_on_device(inputs))
        return
    expected = reference.reference(**to(inputs, torch.float64))
    assert_close(core(**_on_device(inputs)).cpu(), expected, torch.float32, f"{config_id(config)}[fla] parallel", seed)


@needs_fla
@pytest.mark.parametrize("config", PARALLEL_ONLY, ids=config_id)
def test_fla_based_and_rebased_match_the_reference(config, seed):
    core, reference = _pair(config, seed)
    inputs = make_inputs(reference, 2, 3, 37, 5, dtype=torch.float64, seed=seed, requires_grad=True)
    parameters = [p for p in reference.parameters() if p.requires_grad]
    expected = reference.reference(**inputs)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    want = torch.autograd.grad((expected * cotangent).sum(), [*inputs.values(), *parameters])
    low = _on_device(inputs, requires_grad=True)
    out = core(**low)
    assert_close(out.cpu(), expected, torch.float32, f"{config_id(config)}[fla] parallel", seed)
    got = torch.autograd.grad((out * cotangent.to(DEVICE, DTYPE)).sum(), [*low.values(), *(p for p in core.parameters() if p.requires_grad)])
    names = [*inputs, *(name for name, p in reference.named_parameters() if p.requires_grad)]
    for name, grad, target in zip(names, got, want, strict=True):
        assert target.abs().max() > 0, f"the reference's d/d{name} is zero: the check says nothing"
        assert_close(grad.cpu(), target, torch.float32, f"{config_id(config)}[fla] d/d{name}", seed)


@needs_fla
@pytest.mark.parametrize("config", [STATEFUL[0], STATEFUL[1], STATEFUL[5], STATEFUL[7]], ids=config_id)
def test_fla_prefill_state_continues_into_steps(config, seed):
    """prefill -> prefill from its state -> steps == the reference over the whole sequence (the
    state's layout, and the normaliser z of the normalised sum rule, carried through fla)."""
    core, reference = _pair(config, seed)
    inputs = make_inputs(reference, 2, 2, 30, 4, dtype=torch.float64, seed=seed)
    low = _on_device(inputs)
    with torch.no_grad():
        first, state = core.prefill(**variants.time_slice(low, 0, 11))
        second, state = core.prefill(**variants.time_slice(low, 11, 20), state=state)
        third, _ = core.step_loop(variants.time_slice(low, 20), state)
    chained = torch.cat([first, second, third], 2).cpu()
    assert_close(chained, reference.reference(**inputs), torch.float32, f"{config_id(config)}[fla] prefill chain", seed)


@needs_fla
@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("softmax", {}, "flash-linear-attention has no kernel computing this variant's function"),
        ("rwkv", {}, "fla's fused_recurrent_rwkv4 .* is not mapped yet"),
        ("lsh", {}, "flash-linear-attention has no kernel computing this variant's function"),
        ("delta", {"normalize": True}, "fla's delta rule has no attention normaliser"),
        ("based", {"sum_norm": True}, "no sum normalisation"),
    ],
)
def test_fla_refuses_what_it_does_not_compute(name, params, message):
    with pytest.raises(variants.UnsupportedBackend, match=message):
        variants.create(name, 8, backend="fla", **params)


@needs_fla
def test_fla_refusals_at_call_time(monkeypatch):
    with pytest.raises(variants.UnsupportedBackend, match=r"fla's parallel_based takes d_key <= 128, got 256"):
        variants.create("based", 256, backend="fla")
    based = variants.create("based", 4, backend="fla")
    inputs = make_inputs(based, 1, 1, 8, 4, dtype=torch.float32, seed=0)
    with pytest.raises(variants.UnsupportedBackend, match="forms no recurrent state; decoding is backend='torch'"):
        based.prefill(**inputs)
    linear = variants.create("linear", 4, backend="fla")
    with pytest.raises(variants.UnsupportedBackend, match="causal only"):
        linear(**make_inputs(linear, 1, 1, 8, 4, dtype=torch.float32, seed=0), causal=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(variants.UnsupportedBackend, match=r"CPU tensors through Triton's interpreter \(TRITON_INTERPRET=1"):
        linear(**make_inputs(linear, 1, 1, 8, 4, dtype=torch.float32, seed=0))
    with pytest.raises(variants.VariantError, match="backend 'fla' takes no options, got mode"):
        variants.create("linear", 4, backend="fla", backend_options={"mode": "default"})


def test_without_fla_the_backend_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "fla" else real(name, *args))
    with pytest.raises(variants.UnsupportedBackend, match=r"pip install 'attnbench\[fla\]' \(package fla-core\)"):
        variants.create("linear", 8, backend="fla")


def test_a_scenario_skips_the_cells_fla_does_not_compute(tmp_path):
    """softmax[fla] is a skipped cell with the reason; linear[fla] is measured (or skipped naming the missing package)."""
    path = tmp_path / "b.yaml"
    path.write_text("variants: {softmax: {}, linear: {}}\nbackends: [torch, fla]\nreport: {baseline_backend: torch}\naxes: {seq_len: 16}\n")
    cells = {(cell["variant"], cell["backend"]): cell for cell in load_scenario(str(path)).cells()}
    assert "no kernel computing this variant's function" in cells["softmax", "fla"]["skip"]
    assert cells["softmax", "torch"]["skip"] is None
    linear = cells["linear", "fla"]["skip"]
    assert linear is None if importlib.util.find_spec("fla") else "attnbench[fla]" in linear
