"""flash-linear-attention as a backend (``create(..., backend='fla')``, variants/fla_backend.py):
the variants it maps compute attnbench's function, against the float64 torch reference, forward
and every gradient (inputs, β, the log gate, ReBased's γ and β), through the parallel form, the
recurrent step and a prefill chain; the variants it does not map are refused naming the
difference. On a CPU fla's recurrent kernels run through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 there); on a GPU its chunk kernels run natively. Skipped where fla-core
is not installed (``pip install 'attnbench[fla]'``). The inputs of the correctness tests are
the fla core's own (``example_inputs`` in fla's layout), but the prefill chain's (ours). The
chunk size reaches fla's chunk kernels (a recording stand-in for the kernel: they run on CUDA
only) or is refused; a parallel call copies none of its inputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import assert_close, check_forms, config_id, make_inputs, slow_interpreted, to
from torch.utils._python_dispatch import TorchDispatchMode

import variants
from harness.measuring import builders
from harness.running import workloads
from harness.scenarios.scenario import load_scenario
from variants import fla_backend
from variants.base import repeat_heads

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
    """The inputs in DTYPE on DEVICE, in the layout they have."""
    return {name: x.detach().to(DEVICE, DTYPE).requires_grad_(requires_grad) for name, x in inputs.items()}


@pytest.mark.slow
@needs_fla
@pytest.mark.parametrize("config", STATEFUL, ids=config_id)
def test_fla_parallel_and_step_match_the_reference(config, seed):
    """The parallel form and the step loop, forward and every gradient (tests/helpers.check_forms)."""
    core, reference = _pair(config, seed)
    inputs = make_inputs(core, 2, 3, 19, 5, dtype=torch.float64, seed=seed)
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
    inputs = make_inputs(core, 2, 3, 37, 5, dtype=torch.float64, seed=seed, requires_grad=True)
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
@pytest.mark.parametrize("config", [STATEFUL[0], slow_interpreted(STATEFUL[1]), slow_interpreted(STATEFUL[5]), STATEFUL[7]], ids=config_id)
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


#: Packed sequences of 7, 1, 13 and 4 tokens.
CU_SEQLENS = torch.tensor([0, 7, 8, 21, 25], dtype=torch.int32)


@needs_fla
@pytest.mark.parametrize("config", [STATEFUL[0], slow_interpreted(STATEFUL[1]), slow_interpreted(STATEFUL[5]), STATEFUL[7]], ids=config_id)
def test_fla_packed_equals_each_sequence_alone(config, seed):
    """``cu_seqlens`` reach fla's kernels: a packed row == the float64 torch core on each sequence alone, forward
    and the gradients of q, k, v (where fla's kernel has a backward: not the gated rule's recurrent one on a CPU),
    and prefill's states are the sequences' own."""
    core, reference = _pair(config, seed)
    inputs = make_inputs(reference, 1, 2, int(CU_SEQLENS[-1]), 4, dtype=torch.float64, seed=seed)
    backward = DEVICE == "cuda" or config[0] != "gated_delta"
    low, exact = _on_device(inputs, requires_grad=backward), to(inputs, torch.float64, requires_grad=backward)
    bounds = CU_SEQLENS.tolist()
    pieces = [variants.time_slice(exact, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    packed = core(**low, cu_seqlens=CU_SEQLENS.to(DEVICE))
    alone = torch.cat([reference(**piece) for piece in pieces], 2)
    assert_close(packed.cpu(), alone, torch.float32, f"{config_id(config)}[fla] packed", seed)
    if backward:
        got = torch.autograd.grad(packed, [low[n] for n in "qkv"], torch.ones_like(packed))
        for name, grad, target in zip("qkv", got, torch.autograd.grad(alone.sum(), [exact[n] for n in "qkv"])):
            assert_close(grad.cpu(), target, torch.float32, f"{config_id(config)}[fla] packed d/d{name}", seed)
    with torch.no_grad():
        _, states = core.prefill(**low, cu_seqlens=CU_SEQLENS.to(DEVICE))
        for n, piece in enumerate(pieces):
            assert_close(states.weights[n : n + 1].cpu(), reference.prefill(**piece)[1].weights, torch.float32, f"{config_id(config)}[fla] state {n}", seed)


@needs_fla
def test_fla_gated_delta_takes_grouped_value_heads(seed):
    """GVA (fewer q/k heads than value heads) goes to fla's gated delta rule as it is: the parallel form, packed,
    prefill and steps equal the torch core on explicitly repeated heads; fla's ungated rule and linear attention refuse it."""
    core, reference = _pair(("gated_delta", {}), seed)
    drawn = make_inputs(reference, 1, 4, int(CU_SEQLENS[-1]), 4, dtype=torch.float64, seed=seed)
    grouped = drawn | {"q": drawn["q"][:, :2], "k": drawn["k"][:, :2]}
    repeated = {name: repeat_heads(x, 4) for name, x in grouped.items()}
    low = _on_device(grouped)
    with torch.no_grad():
        assert_close(core(**low).cpu(), reference(**repeated), torch.float32, "gated_delta[fla] GVA", seed)
        assert_close(core(**low, cu_seqlens=CU_SEQLENS.to(DEVICE)).cpu(), reference(**repeated, cu_seqlens=CU_SEQLENS), torch.float32, "GVA packed", seed)
        first, state = core.prefill(**variants.time_slice(low, 0, 20))
        assert state.weights.shape[1] == 4
        steps, _ = core.step_loop(variants.time_slice(low, 20), state)
        assert_close(torch.cat([first, steps], 2).cpu(), reference(**repeated), torch.float32, "gated_delta[fla] GVA prefill and steps", seed)
    for name, heads in (("delta", (1, 1, 2)), ("linear", (2, 1, 1))):
        assert "takes no grouped heads" in variants.supports(name, 6, ["fla"], heads=heads)["fla"]


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
    cells = {(cell.variant, cell.backend): cell for cell in load_scenario(str(path)).cells()}
    assert "no kernel computing this variant's function" in cells["softmax", "fla"].skip
    assert cells["softmax", "torch"].skip is None
    linear = cells["linear", "fla"].skip
    assert linear is None if importlib.util.find_spec("fla") else "attnbench[fla]" in linear


# --- the chunk size fla runs, and its layout --------------------------------------------------------


@needs_fla
@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("linear", {"chunk_size": 32}, "linear: fla's chunk_linear_attn runs chunk_size 64, got chunk_size=32"),
        ("performer", {"m": 4, "chunk_size": 128}, "performer: fla's chunk_linear_attn runs chunk_size 64, got chunk_size=128"),
        ("delta", {"chunk_size": 128}, "delta: fla's chunk_delta_rule runs chunk_size 16, 32, 64, got chunk_size=128"),
        ("gated_delta", {"chunk_size": 8}, "gated_delta: fla's chunk_gated_delta_rule runs chunk_size 16, 32, 64, got chunk_size=8"),
        ("based", {"chunk_size": 32}, "based: fla's parallel_based has no chunk (leave chunk_size at 64), got chunk_size=32"),
    ],
)
def test_fla_refuses_a_chunk_size_its_kernel_does_not_run(name, params, message):
    with pytest.raises(variants.UnsupportedBackend) as info:
        variants.create(name, 8, backend="fla", **params)
    assert str(info.value) == message


class _RecordingKernel:
    """Stands in for one of fla's ops: records the keywords and the tensors it is given, then runs
    ``compute`` (fla's recurrent kernel, whose function is the same without a chunk) or, without
    one, returns NaN outputs shaped like v and (``stateful``) the initial state as the final one."""

    def __init__(self, compute=None, stateful=True):
        self.compute, self.stateful, self.calls = compute, stateful, []

    def __call__(self, *tensors, **options):
        self.calls.append((tensors, {key: value for key, value in options.items() if not isinstance(value, torch.Tensor)}, options))
        options = {key: value for key, value in options.items() if key != "chunk_size"}
        if self.compute is not None:
            return self.compute(*tensors, **options)
        out = torch.full_like(tensors[2], float("nan"))
        return (out, options.get("initial_state")) if self.stateful else out


def _in_float32(kernel, dtype):
    """``kernel`` run in float32 (fla's recurrent kernels in the interpreter), its outputs in ``dtype``."""
    widen = lambda x: x.float() if isinstance(x, torch.Tensor) else x  # noqa: E731

    def run(*tensors, **options):
        return tuple(None if x is None else x.to(dtype) for x in kernel(*map(widen, tensors), **{key: widen(x) for key, x in options.items()}))

    return run


@needs_fla
@pytest.mark.parametrize(("name", "chunk_size"), [slow_interpreted("delta", 16), ("delta", 32), ("gated_delta", 32), slow_interpreted("gated_delta", 64)])
def test_the_chunk_size_reaches_fla_chunk_kernel(monkeypatch, name, chunk_size, seed):
    """On CUDA the delta rules run fla's chunk kernel at the core's chunk_size; ``flops`` counts that
    chunk and ``implementation_choices`` records it. Here the kernel is a recording stand-in that
    computes with fla's recurrent kernel (the chunk kernels run on CUDA only; chunk_delta_rule in
    16 bits only: bfloat16 for it, float32 for the gated rule)."""
    core, reference = _pair((name, {"chunk_size": chunk_size}), seed)
    rule = fla_backend._ops("gated_delta_rule" if name == "gated_delta" else "delta_rule")
    kernel_name = core.fla_kernels["chunk"]
    dtype = torch.bfloat16 if name == "delta" else torch.float32
    stand_in = _RecordingKernel(_in_float32(getattr(rule, core.fla_kernels["recurrent"]), dtype))
    monkeypatch.setattr(rule, kernel_name, stand_in)
    monkeypatch.setattr(fla_backend, "_where", lambda variant, device: "chunk")
    inputs = make_inputs(core, 2, 3, 40, 5, dtype=torch.float64, seed=seed)
    out, expected = core(**to(inputs, dtype)).double(), reference.reference(**inputs)
    assert [options["chunk_size"] for _, options, _ in stand_in.calls] == [chunk_size]
    assert ((out - expected).norm() / expected.norm()).item() < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"{name}[fla] chunk {chunk_size} (seed {seed})"
    from variants.kernels.identity import fla_identity

    assert core.implementation_choices(**inputs) == {"fla_kernel": kernel_name, "chunk_size": chunk_size, **fla_identity()}
    assert core.flops(2, 3, 40, 5) == reference.flops(2, 3, 40, 5) != variants.create(name, 6, chunk_size=chunk_size // 2).flops(2, 3, 40, 5)


@needs_fla
def test_the_fla_kernel_without_a_chunk_is_recorded_and_counted_as_it_runs():
    linear, based = variants.create("linear", 8, backend="fla"), variants.create("based", 8, backend="fla")
    from variants.kernels.identity import fla_identity

    versions = fla_identity()
    assert linear.implementation_choices(**linear.example_inputs(1, 2, 8, 8)) == {"fla_kernel": "fused_recurrent_linear_attn", "chunk_size": None, **versions}
    assert based.implementation_choices(**based.example_inputs(1, 2, 8, 8)) == {"fla_kernel": "parallel_based", "chunk_size": None, **versions}
    assert based.flops(2, 3, 10, 5) == 2 * 2 * 3 * 55 * (8 + 5)  # the 55 visible pairs of 10 tokens, q·k and the weighted sum of v


class _Copies(TorchDispatchMode):
    """Counts the ATen ops within the block that copy a tensor (clone, copy_, _to_copy)."""

    COPIES = ("clone", "copy_", "_to_copy")

    def __enter__(self):
        self.copies = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.COPIES:
            self.copies.append(func.__name__)
        return func(*args, **(kwargs or {}))


#: Each mapping with the fla op its parallel form calls on a CPU (the module under fla.ops and the name).
NO_COPY = [
    (("linear", {}), "linear_attn", "fused_recurrent_linear_attn"),
    (("linear", {"phi": "identity", "normalize": False}), "linear_attn", "fused_recurrent_linear_attn"),
    (("performer", {"m": 4}), "linear_attn", "fused_recurrent_linear_attn"),
    (("dpfp", {"nu": 1}), "linear_attn", "fused_recurrent_linear_attn"),
    (("delta", {}), "delta_rule", "fused_recurrent_delta_rule"),
    (("deltanet", {}), "delta_rule", "fused_recurrent_delta_rule"),
    (("gated_delta", {}), "gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    (("based", {}), "based", "parallel_based"),
    (("rebased", {}), "rebased", "parallel_rebased"),
]


@needs_fla
@pytest.mark.parametrize(("config", "module", "kernel"), NO_COPY, ids=[config_id(config) for config, _, _ in NO_COPY])
def test_a_parallel_call_copies_none_of_its_inputs(monkeypatch, config, module, kernel):
    """With the inputs the harness times (``example_inputs``, in the core's ``input_layout``), the
    parallel form hands fla's op its inputs as they are: v, β and the log gate are the inputs' own
    storage, φ(q) and φ(k) computed in fla's layout, and no copy runs before the op (which reads
    contiguous [B, T, H, D]; Based's parallel kernel transposes back to contiguous [B, H, T, D])."""
    name, params = config
    core = variants.create(name, 6, backend="fla", **params).to(DTYPE)  # as the harness builds it: buffers (FAVOR+'s ω) in the cell's dtype
    stand_in = _RecordingKernel(stateful=not kernel.startswith("parallel"))
    monkeypatch.setattr(fla_backend._ops(module), kernel, stand_in)
    inputs = core.example_inputs(2, 3, 16, 5, generator=torch.Generator().manual_seed(0))
    with _Copies() as log:
        core(**inputs)
    assert log.copies == [], f"copies inside the timed call: {log.copies}"
    ((tensors, _, options),) = stand_in.calls
    given = dict(zip("qkv", tensors)) | options
    reads = {label: x.transpose(1, 2) if kernel.startswith("parallel") else x for label, x in given.items() if isinstance(x, torch.Tensor)}
    assert all(x.is_contiguous() for x in reads.values()), {label: x.stride() for label, x in reads.items()}
    for label in ("v", "beta", "g"):
        if label in given:
            assert given[label].data_ptr() == inputs["log_gate" if label == "g" else label].data_ptr(), f"{label} was copied"


@needs_fla
def test_torch_layout_inputs_still_work_through_a_copy(seed):
    """Inputs in our layout (not the core's) give the same result: fla's layout made by a copy."""
    core, reference = _pair(("delta", {}), seed)
    inputs = make_inputs(reference, 1, 2, 12, 4, dtype=torch.float64, seed=seed)
    assert not inputs["q"].transpose(1, 2).is_contiguous()
    assert_close(core(**to(inputs, DTYPE)), reference.reference(**inputs), DTYPE, "delta[fla] from [B, H, T, D] storage", seed)


@needs_fla
def test_an_fla_cell_records_its_kernel_chunk_and_versions(tmp_path):
    """Besides the op and its chunk, the versions its kernels come from (issue 32 item 4: kernel identity)."""
    import fla
    import triton

    path = tmp_path / "f.yaml"
    path.write_text(
        "variants: {delta: {chunk_size: 32}}\nbackends: [fla]\naxes: {seq_len: 8, batch: 1, heads: 1, d_key: 4}\nmeasure: {warmup: 0, repeats: 1}\n"
    )
    (cell,) = load_scenario(str(path)).cells()
    result = workloads.measure_cell(cell)
    assert result["status"] == "ok", result["error"]
    assert (result["metrics"]["fla_kernel"], result["metrics"]["chunk_size"]) == ("fused_recurrent_delta_rule", None)
    assert (result["metrics"]["fla_version"], result["metrics"]["triton_version"]) == (fla.__version__, triton.__version__) != (None, None)


@needs_fla
@pytest.mark.parametrize("name", ["linear", "gated_delta"])
def test_a_decode_cell_copies_no_input_in_its_prefill_or_steps(tmp_path, monkeypatch, name):
    """The decode cell's prompt is laid out for the core and each token's inputs are contiguous, so
    neither the timed prefill nor a timed step copies them (fla's recurrent kernel: a stand-in)."""
    path = tmp_path / "d.yaml"
    path.write_text(
        f"variants: {{{name}: {{}}}}\nbackends: [fla]\nmodes: [decode]\ndecode: {{new_tokens: 3}}\naxes: {{seq_len: 6, batch: 2, heads: 3, d_key: 4}}\n"
    )
    (cell,) = load_scenario(str(path)).cells()
    core = variants.create(name, 4, backend="fla")
    monkeypatch.setattr(fla_backend._ops("linear_attn" if name == "linear" else "gated_delta_rule"), core.fla_kernels["recurrent"], _RecordingKernel())
    decoder = builders.build_decoder(cell, torch.device("cpu"), torch.float32, 6, 3)
    with torch.no_grad(), _Copies() as log:
        _, state = decoder.prefill()
        for i in range(3):
            _, state = decoder.step(i, state)
    assert log.copies == [], f"copies inside the timed prefill and steps: {log.copies}"
