"""``state_numel`` counts the decoding state a prefill returns (decode cells' memory column and roofline read it), for
every shipped variant, at d_key ≠ d_value; ``attnbench check`` fails a variant whose count is not its state's."""

from __future__ import annotations

import pytest

import variants
from variants.checking import LONG, _interface


@pytest.mark.parametrize("name", variants.names())
def test_state_numel_counts_the_state_after_a_prefill(name):
    (line,) = [check for check in _interface(variants.create(name, d_key=8).double(), 6) if "state_numel" in check.what]
    assert line.ok, line.line()


def test_check_names_a_count_that_is_not_the_states(monkeypatch):
    core = variants.create("linear", d_key=8).double()
    monkeypatch.setattr(core, "state_numel", lambda batch, heads, d_value, length: batch * heads * 8 * d_value)  # the normaliser forgotten
    (line,) = [check for check in _interface(core, 6) if "state_numel" in check.what]
    assert not line.ok
    assert f"the state after a prefill of {LONG} tokens holds 224 elements ([2, 2, 8, 6], [2, 2, 8]), not 192" in line.cause, line.cause
