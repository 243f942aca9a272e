"""The chunked scans' autograd graphs stay linear in T: the sequence is cut by one ``split``
and the outputs joined by one ``cat``. A slice of a full-length tensor per chunk (or a
slice write into a preallocated output) makes the backward touch a full-length tensor once
per chunk; that made training 2.5x slower at T = 2048 and is checked here without timing. The
parallel scans (``scan='parallel'``) cut nothing per chunk, and are held to the same rule."""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, config_id

import variants

LINEAR_TIME = [(name, params) for name, params in CONFIGS if variants.create(name, 8, **params).d_dot is not None]
LENGTH, CHUNK = 40, 8


def graph_nodes(output: torch.Tensor):
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(parent for parent, _ in node.next_functions)


@pytest.mark.parametrize("config", LINEAR_TIME, ids=config_id)
def test_no_chunk_slices_or_writes_a_full_length_tensor(config):
    name, params = config
    core = variants.create(name, 8, **dict(params, chunk_size=CHUNK))
    inputs = core.example_inputs(1, 2, LENGTH, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    kinds = []
    for node in graph_nodes(core(**inputs)):
        kinds.append(type(node).__name__)
        assert kinds[-1] != "CopySlices", f"{name}: a slice write into a full-length output"
        if kinds[-1] == "SliceBackward0":
            sizes = node._saved_self_sym_sizes
            assert not (len(sizes) >= 3 and sizes[2] == LENGTH and node._saved_dim == 2), f"{name}: a per-chunk slice of the sequence"
    if params.get("scan") != "parallel":
        assert "SplitBackward0" in kinds  # the scan ran chunk by chunk
