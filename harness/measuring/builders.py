"""What a cell builds: its core, layer or model on its device and dtype, the seeded inputs, and one
iteration to time (``Workload``: forward; train, forward + backward and for a model the optimiser
step; ``build_decoder``: a prefill and single steps). Shared by the measurement
(``harness.running.workloads``) and the accuracy check (``harness.measuring.accuracy``)."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

import variants


class CellError(ValueError):
    """A cell that cannot be built as specified (recorded as an error, the sweep goes on)."""


@dataclass
class Workload:
    """One iteration (``run``) with how many tokens and FLOPs it processes and the bytes no
    implementation can avoid moving (``min_bytes``: docs/results.md, "Roofline"); the ``module``
    it calls and that call's ``inputs`` by name (``module(**inputs)``), for the accuracy check."""

    run: Callable[[], torch.Tensor]
    tokens: int
    flops: int
    min_bytes: int
    module: torch.nn.Module
    inputs: dict


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (read at least once per call)."""
    return tensor_bytes(module.parameters()) + tensor_bytes(module.buffers())


def seeded_generator(device):
    return torch.Generator(device=device).manual_seed(0)


def backend_arguments(cell, backend: str | None = None) -> dict:
    """The cell's backend and its options (``backend_options``), as ``variants.create`` takes them;
    ``backend`` (e.g. "torch", for a float64 reference) in place of the cell's, without options."""
    if backend is not None:
        return {"backend": backend}
    return {"backend": cell.backend, "backend_options": cell.backend_options}


def build_core(cell, backend: str | None = None):
    return variants.create(cell.variant, cell.axes["d_key"], **backend_arguments(cell, backend), **cell.params)


def head_counts(core, axes) -> tuple[int, int, int]:
    """The heads of q, k and v in a cell: ``heads`` each, or with ``axes.head_ratio`` r the core's
    grouping (``head_grouping``) on ``heads`` output heads: GQA's k and v, GVA's q and k on heads / r
    (a core without one: GQA's shape, which it refuses)."""
    heads, ratio = axes["heads"], axes.get("head_ratio", 1)
    fewer = heads // ratio
    return (fewer, fewer, heads) if ratio > 1 and core.head_grouping == "gva" else (heads, fewer, fewer)


def head_arguments(core, axes) -> tuple[int, dict]:
    """The query heads and the ``heads_k``, ``heads_v`` keywords of ``flops``, ``step_flops`` and
    ``state_numel`` for the cell's grouped heads (none where every tensor has ``heads``)."""
    q, k, v = head_counts(core, axes)
    return q, ({"heads_k": k, "heads_v": v} if (q, k) != (v, v) else {})


def lengths_of(cell) -> list[int]:
    """The length of each sequence of the cell: its packed batch's (``cell.lengths``), else
    ``seq_len`` for each of ``batch``."""
    return cell.lengths or [cell.axes["seq_len"]] * cell.axes["batch"]


def decode_contexts(cell, context: int) -> list[int]:
    """Each decoded sequence's prompt length: a cell of mixed lengths its ``lengths_of``, else ``context``
    for each of ``batch``."""
    return lengths_of(cell) if cell.lengths is not None else [context] * cell.axes["batch"]


def packed(cell) -> bool:
    return cell.axes.get("packing") == "packed"


def pack(inputs: dict, lengths, layout: str) -> dict:
    """The first ``lengths[n]`` tokens of each row n of ``inputs`` (``[N, H, T, ...]``) packed into one
    row ``[1, H, sum(lengths), ...]`` in ``layout``, with their ``cu_seqlens``."""
    device = inputs["q"].device
    rows = {name: variants.in_layout(torch.cat([x[n : n + 1, :, :length] for n, length in enumerate(lengths)], 2), layout) for name, x in inputs.items()}
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return rows | {"cu_seqlens": offsets}


def shaped_inputs(core, axes, lengths, device, dtype, requires_grad) -> dict:
    """The core's own example inputs (q, k, v and whatever per-token inputs it declares) drawn from a
    generator seeded 0 on ``device`` for ``batch`` × ``seq_len``, on the cell's grouped heads
    (``head_counts``; token inputs on the output's heads); with ``lengths``, row n's first
    ``lengths[n]`` tokens packed into one row with their ``cu_seqlens`` (``pack``)."""
    batch, seq_len = (len(lengths), max(lengths)) if lengths else (axes["batch"], axes["seq_len"])
    inputs = core.example_inputs(batch, axes["heads"], seq_len, axes["d_value"], device=device, dtype=dtype, generator=seeded_generator(device))
    q, k, v = head_counts(core, axes)
    if (q, k, v) != (axes["heads"],) * 3:
        inputs |= {name: variants.in_layout(inputs[name][:, :heads].clone(), core.input_layout) for name, heads in (("q", q), ("k", k), ("v", v))}
    if lengths:
        inputs = pack(inputs, lengths, core.input_layout)
    return {name: x.requires_grad_(requires_grad and x.is_floating_point()) for name, x in inputs.items()}


def attention_inputs(core, cell, device, dtype, requires_grad) -> dict:
    """The inputs of a core cell (``shaped_inputs``): a packed cell's sequences in one row."""
    return shaped_inputs(core, cell.axes, cell.lengths if packed(cell) else None, device, dtype, requires_grad)


def core_counts(core, cell) -> tuple[int, int]:
    """``(tokens, flops)`` of one call of a core cell: real tokens only (never a padded batch's padding),
    and the FLOPs of the real sequences (``core.flops`` per length, on the grouped heads)."""
    lengths, axes = lengths_of(cell), cell.axes
    heads, grouped = head_arguments(core, axes)
    flops = sum(core.flops(count, heads, length, axes["d_value"], **grouped) for length, count in collections.Counter(lengths).items())
    return sum(lengths), flops


def core_workload(cell, device, dtype) -> Workload:
    axes = cell.axes
    core = build_core(cell).to(device=device, dtype=dtype)
    train = cell.mode == "train"
    inputs = attention_inputs(core, cell, device, dtype, train)
    tokens, flops = core_counts(core, cell)
    real = tokens / (inputs["q"].shape[0] * inputs["q"].shape[2])  # a padded batch's fraction of real tokens: bytes of these only
    read = int(real * tensor_bytes(inputs.values()))
    output = tokens * axes["heads"] * axes["d_value"] * inputs["v"].element_size()
    if not train:
        return Workload(torch.no_grad()(lambda: core(**inputs)), tokens, flops, read + output + module_bytes(core), core, inputs)
    leaves = [x for x in inputs.values() if x.requires_grad]
    shape = (inputs["q"].shape[0], axes["heads"], inputs["q"].shape[2], axes["d_value"])
    cotangent = torch.randn(shape, device=device, dtype=dtype) * real_positions(cell, shape, device, dtype)

    def forward_backward():
        out = core(**inputs)
        torch.autograd.grad(out, leaves, cotangent)
        return out.detach()

    # inputs read and their gradients written, output written and its cotangent read
    return Workload(forward_backward, tokens, 3 * flops, 2 * (read + output) + module_bytes(core), core, inputs)


def real_positions(cell, shape, device, dtype) -> torch.Tensor | float:
    """1 at each real token of a padded batch ``shape`` (``[N, H, T, D]``) and 0 at its padding (a
    training loss ignores padding); 1 elsewhere."""
    if cell.lengths is None or packed(cell):
        return 1.0
    lengths = torch.tensor(cell.lengths, device=device)
    return (torch.arange(shape[2], device=device) < lengths[:, None]).to(dtype)[:, None, :, None]


def build_layer(cell, device, dtype, backend: str | None = None):
    axes = cell.axes
    layer = variants.AttentionLayer(
        axes["heads"] * axes["d_value"],
        axes["heads"],
        cell.variant,
        d_key=axes["d_key"],
        d_value=axes["d_value"],
        **backend_arguments(cell, backend),
        **cell.params,
    )
    return layer.to(device=device, dtype=dtype)


def layer_input(axes, length: int, device, dtype) -> torch.Tensor:
    """A layer's input ``[B, length, heads · d_value]`` ~ N(0, 1) from the seed-0 generator."""
    x = torch.randn(axes["batch"], length, axes["heads"] * axes["d_value"], generator=seeded_generator(device), device=device)
    return x.to(dtype)


def layer_flops(layer, axes) -> int:
    """The core's FLOPs plus 2 per weight per token for the projections."""
    projections = sum(p.numel() for name, p in layer.named_parameters() if name.endswith("weight") and not name.startswith("core"))
    tokens = axes["batch"] * axes["seq_len"]
    return layer.core.flops(axes["batch"], axes["heads"], axes["seq_len"], axes["d_value"]) + 2 * projections * tokens


def layer_workload(cell, device, dtype) -> Workload:
    axes = cell.axes
    layer = build_layer(cell, device, dtype)
    x = layer_input(axes, axes["seq_len"], device, dtype)
    tokens, flops = axes["batch"] * axes["seq_len"], layer_flops(layer, axes)
    read = tensor_bytes([x]) + module_bytes(layer)
    if cell.mode != "train":
        return Workload(torch.no_grad()(lambda: layer(x)), tokens, flops, read + tensor_bytes([x]), layer, {"x": x})
    x.requires_grad_(True)
    leaves = [x, *layer.parameters()]

    def forward_backward():
        out = layer(x)
        torch.autograd.grad(out.float().square().mean(), leaves)
        return out.detach()

    # x and the weights read and their gradients written, the output written
    return Workload(forward_backward, tokens, 3 * flops, 2 * read + tensor_bytes([x]), layer, {"x": x})


def build_model(cell, device, dtype, backend: str | None = None):
    """The cell's DecoderLM (its preset, vocabulary and overrides, the cell's variant) and its config."""
    from ..models import lm_config
    from ..models.decoder import DecoderLM

    spec = cell.model
    variant_params = dict(cell.params, **backend_arguments(cell, backend))
    config = lm_config(spec["preset"], spec["vocab_size"], variant=cell.variant, variant_params=variant_params, **spec["overrides"])
    return DecoderLM(config).to(device=device, dtype=dtype), config


def model_tokens(config, axes, device) -> torch.Tensor:
    """Random tokens ``[B, seq_len + 1]`` (inputs and next-token targets) from the seed-0 generator."""
    return torch.randint(config.vocab_size, (axes["batch"], axes["seq_len"] + 1), generator=seeded_generator(device), device=device)


def model_workload(cell, device, dtype) -> Workload:
    axes, spec = cell.axes, cell.model
    model, config = build_model(cell, device, dtype)
    d_head = config.d_model // config.n_heads
    if (axes["heads"], axes["d_key"]) != (config.n_heads, d_head):
        raise CellError(
            f"model preset {spec['preset']!r} has {config.n_heads} heads of dimension {d_head}; "
            f"set axes.heads={config.n_heads} and axes.d_key={d_head} (got heads={axes['heads']}, d_key={axes['d_key']})"
        )
    if axes["seq_len"] > config.context:
        raise CellError(f"seq_len={axes['seq_len']} exceeds the model's context {config.context}")
    tokens = model_tokens(config, axes, device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    count = axes["batch"] * axes["seq_len"]
    attention = model.blocks[0].attn.core.flops(axes["batch"], config.n_heads, axes["seq_len"], d_head)
    dense = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "pos" not in name)
    flops = 2 * dense * count + config.n_layers * attention
    if cell.mode != "train":
        logits = count * config.vocab_size * torch.finfo(dtype).bits // 8
        return Workload(torch.no_grad()(lambda: model(inputs)), count, flops, tensor_bytes([inputs]) + module_bytes(model) + logits, model, {"tokens": inputs})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    # the tokens read; the weights and Adam's two moments read and written (gradients fused away)
    return Workload(train_step, count, 3 * flops, tensor_bytes([tokens]) + 6 * tensor_bytes(model.parameters()), model, {"tokens": inputs})


BUILDERS = {"core": core_workload, "layer": layer_workload, "model": model_workload}


def build_decoder(cell, device, dtype, context, new_tokens):
    """``(core, prefill() -> (out, state), step(i, state) -> (out, state), step_bytes)`` for a
    decode cell; ``step_bytes``: what a step reads and writes besides the state (its token's
    inputs, its output, the weights). Its ``.module`` is what decodes (the core or the layer) and
    ``.inputs`` the whole sequence (the core's inputs, or the layer's ``{"x": ...}``). A core cell of
    mixed lengths decodes its sequences together, each from its own length (``lengths_of``), row n's
    inputs its first lengths[n] + new_tokens tokens: prefilled packed (``cu_seqlens``), or padded, the
    prompts a dense batch ``[N, H, longest]`` padded at their end (``prefill(lengths=)``)."""
    axes = cell.axes
    if cell.target == "core":
        core = build_core(cell).to(device=device, dtype=dtype)
        contexts = decode_contexts(cell, context)
        inputs = shaped_inputs(core, dict(axes, batch=len(contexts), seq_len=max(contexts) + new_tokens), None, device, dtype, False)
        # the prompt in the core's layout (a packed batch's prompts packed, each prefilled to its own length) and each
        # step's inputs, row n's token contexts[n] + i, contiguous, so that no timed call copies them
        if packed(cell):
            prompt = pack(inputs, contexts, core.input_layout)
        else:
            prompt = {name: variants.in_layout(x, core.input_layout) for name, x in variants.time_slice(inputs, 0, max(contexts)).items()}
            prompt |= {"lengths": contexts} if cell.lengths is not None else {}
        rows, at = torch.arange(len(contexts), device=device), torch.tensor(contexts, device=device)
        tokens = [{f"{name}_t": x[rows, :, at + i].contiguous() for name, x in inputs.items()} for i in range(new_tokens)]
        prefill = lambda: core.prefill(**prompt)  # noqa: E731
        step = lambda i, state: core.step(**tokens[i], state=state)  # noqa: E731
        output = len(contexts) * axes["heads"] * axes["d_value"] * inputs["v"].element_size()
        return Decoder(core, prefill, step, tensor_bytes(tokens[0].values()) + output + module_bytes(core), core, inputs)
    layer = build_layer(cell, device, dtype)
    x = layer_input(axes, context + new_tokens, device, dtype)
    step_bytes = 2 * tensor_bytes([x[:, context]]) + module_bytes(layer)  # the token in, its output out, the weights
    return Decoder(layer.core, (lambda: layer.prefill(x[:, :context])), (lambda i, state: layer.step(x[:, context + i], state)), step_bytes, layer, {"x": x})


class Decoder(NamedTuple):
    """What ``build_decoder`` builds: the core, the prefill and step calls, the bytes a step moves besides
    the state, the module that decodes and its inputs over the whole sequence."""

    core: variants.AttentionCore
    prefill: Callable
    step: Callable
    step_bytes: int
    module: torch.nn.Module
    inputs: dict
