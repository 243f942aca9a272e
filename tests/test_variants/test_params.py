"""A core's parameters pass one place (``variants.create``, after ``params.check``) and reach every
backend from the built core (issue 33): a wrong value ends in one line naming the parameter and
what it expects (issue 36: before, FAVOR+ with m = 10^12 ended in a C++ allocator error and a
seed torch cannot take in "an attnbench bug?"), and a parameter only some backends honour is
refused, naming them, on the others (``supports`` says so before anything is built but the torch core)."""

from __future__ import annotations

import pytest

import variants
from harness.cli import main
from variants import base
from variants.params import choice
from variants.sum_rule import SumRule


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("performer", {"m": 10**12}, "performer: m must be at most 1048576, got 1000000000000"),
        ("performer", {"d_dot": 10**11}, "performer: d_dot must be at most 1048576, got 100000000000"),
        ("performer", {"m": True}, "performer: m must be a positive int, got True"),
        ("performer", {"seed": "abc"}, "performer: seed must be an int >= 0, got 'abc'"),
        ("performer", {"seed": 10**23}, "performer: seed must be at most 9223372036854775807, got 100000000000000000000000"),
        ("lsh", {"seed": 1.5}, "lsh: seed must be an int >= 0, got 1.5"),
        ("linear", {"normalize": "no"}, "linear: normalize must be true or false, got 'no'"),
        ("delta", {"sum_norm": 1}, "delta: sum_norm must be true or false, got 1"),
        ("rwkv", {"chunk_size": True}, "rwkv: chunk_size must be a positive int, got True"),
        ("softmax", {"scale": float("nan")}, "softmax: scale must be a finite number > 0, got nan"),
        ("based", {"phi": "elu1"}, "based: phi is set by the variant itself, not a parameter of it, got 'elu1'"),
        ("performer", {"phi": "favor"}, "performer: phi is set by the variant itself, not a parameter of it, got 'favor'"),
        ("linear", {"precision": "x" * 500}, "linear: precision must be one of 'ieee', 'tf32', got '" + "x" * 59 + "…"),
    ],
)
def test_a_bad_parameter_is_one_line_naming_it(name, params, message):
    with pytest.raises(variants.VariantError) as info:
        variants.create(name, 8, **params)
    assert str(info.value) == message


def test_through_attnbench_run_it_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text("variants: {performer: {m: 1000000000000}}\naxes: {seq_len: 8, batch: 1, heads: 1, d_key: 8}\n")
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "variants.performer" in err and "m must be at most 1048576" in err and "attnbench bug" not in err, err


class _Scanned(SumRule):
    """The sum rule with a new option of its PyTorch forms only (as ``scan`` is): it reaches every backend."""

    PARAMS = {"order": choice("auto", "forward", "reverse", backends=("torch", "compile"), default="auto", scope="orders the PyTorch scan")}

    def __init__(self, d_key, *, order="auto", **options):
        super().__init__(d_key, **options)
        self.order = order


def test_a_parameter_some_backends_honour_is_refused_on_the_others(monkeypatch):
    monkeypatch.setitem(base._REGISTRY, "scanned", _Scanned)
    fla = "flash-linear-attention" if variants.supports("linear", 8, ["fla"])["fla"] is None else None
    reasons = variants.supports("scanned", 8, order="reverse")
    assert reasons["torch"] is None and reasons["compile"] is None
    expected = "scanned: order='reverse' orders the PyTorch scan; backend='{}' runs its kernels"
    expected += " (use backend='torch' or backend='compile', or leave order at 'auto')"
    assert reasons["triton"] == expected.format("triton")
    if fla:
        assert reasons["fla"] == expected.format("fla")
    assert variants.supports("scanned", 8, ["triton", "fla"], order="auto") == variants.supports("linear", 8, ["triton", "fla"])
    with pytest.raises(variants.UnsupportedBackend, match="order='forward' orders the PyTorch scan"):
        variants.create("scanned", 8, backend="triton", order="forward")
    with pytest.raises(variants.VariantError, match="scanned: order must be one of 'auto', 'forward', 'reverse', got 3"):
        variants.supports("scanned", 8, order=3)
    assert variants.create("scanned", 8, order="forward").order == "forward"


@pytest.mark.parametrize("backend", ["triton", "fla"])
def test_scan_reaches_the_kernel_backends_and_is_refused_there(backend):
    """``scan`` (how the PyTorch forms run the chunks) is refused by the kernels unless left at 'auto'."""
    reason = variants.supports("delta", 8, [backend], scan="parallel")[backend]
    assert reason is not None and reason.startswith(f"delta: scan='parallel' picks a PyTorch form; backend='{backend}' runs its kernels")
    assert variants.supports("delta", 8, ["torch", "compile"], scan="parallel") == {"torch": None, "compile": None}


def test_supports_names_what_create_refuses():
    """``supports`` and ``create`` agree: a refusal's reason is the error ``create`` raises (torch.compile,
    slow to import, left out: 'compile' takes what 'torch' takes)."""
    for name in variants.names():
        for backend, reason in variants.supports(name, 8, ["torch", "triton", "fla"]).items():
            if reason is None:
                assert variants.create(name, 8, backend=backend).backend == backend
            else:
                with pytest.raises(variants.UnsupportedBackend) as info:
                    variants.create(name, 8, backend=backend)
                assert str(info.value) == reason


def test_supports_names_the_inputs_a_backend_refuses():
    """fla's chunk kernel of the delta rule (CUDA) asserts 16-bit inputs: refused for float32 on CUDA, not on the CPU."""
    if variants.supports("delta", 8, ["fla"])["fla"] is not None:
        pytest.skip("flash-linear-attention is not installed")
    assert "refuses float32" in variants.supports("delta", 8, ["fla"], dtype="float32", device="cuda")["fla"]
    assert variants.supports("delta", 8, ["fla"], dtype="bfloat16", device="cuda")["fla"] is None
    assert variants.supports("delta", 8, ["fla"], dtype="float32", device="cpu")["fla"] is None
    assert variants.supports("gated_delta", 8, ["fla"], dtype="float32", device="cuda")["fla"] is None
