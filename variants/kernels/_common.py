"""What the two Triton kernel files share: output buffers, the dot precision, tile sizes, input
checks, the launch, @triton.jit tile helpers, and the recording of launches that
``attnbench kernels`` compiles for GPU targets without a GPU.

Constexpr names, the same in every kernel: ``BLOCK_C`` the chunk padded to a power of two ≥ 16,
``BLOCK_F`` / ``BLOCK_V`` the rows (d_dot side) / columns (d_value side) of the state one program
holds, ``PAD_V`` d_value padded (the row stride of padded internal buffers), ``PRECISION`` the
precision of ``dot`` (``operand_precision``: IEEE or TF32 fp32, or 16-bit operands). Runtime sizes: ``seq_len, d_dot, d_value, chunk_size, num_chunks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl

from ..base import UnsupportedBackend, VariantError
from . import MAX_HEAD_DIM, PRECISIONS, _interpreter, chunk_sizes, identity

if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter.patch_scalar_index()

#: Tests set this: new outputs and gradients start as NaN, so an element no kernel writes shows.
POISON = False
#: tl.dot precision for float32 inputs by default ("ieee": true fp32; "tf32", asked with
#: ``precision="tf32"`` (one of ``PRECISIONS``), is faster and ~1e-3 relative).
FP32_DOT_PRECISION = "ieee"
#: The first compute capability (×10) with TF32 tensor cores (A100, sm_80).
TF32_CAPABILITY = 80
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Shapes ``attnbench kernels`` compiles: B·H and T of the reference shape; head dims (d_dot = d_value) and
#: the d-dot-sweep's wide keys (d_dot 128 and 256 with d_value 64), each at every chunk size its rule takes.
REFERENCE_BATCH, REFERENCE_HEADS, REFERENCE_SEQ_LEN = 1, 8, 16384
HEAD_DIMS = (16, 32, 64, 128, 256)
#: The packed rows' offsets (``cu_seqlens``): the reference T cut into sequences of 1000, 2100, 1, 3899, 4111 and 5273
#: tokens (none a whole number of chunks). A handful of packed configurations per rule, not the table doubled.
PACKED_BOUNDS = (0, 1000, 3100, 3101, 7000, 11111, 16384)
WIDE_KEYS = (128, 256)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

_recording: list | None = None
_recording_capability: int | None = None


def pad(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(n))


def new_output(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A buffer a kernel writes, on ``like``'s device: NaN-filled when ``POISON`` is set, else uninitialised."""
    dtype = like.dtype if dtype is None else dtype
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def capability(device: torch.device) -> int | None:
    """Compute capability ×10 of a CUDA device (80 for sm_80), the recorded target on "meta", None on the CPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return _recording_capability if device.type == "meta" else None


def operand_precision(dtype: torch.dtype, capability: int | None, fp32: str | None = None) -> str:
    """``PRECISION`` of the chunk-parallel kernels (``dot``): for float32 ``fp32`` (default
    ``FP32_DOT_PRECISION``; "tf32" falls back to "ieee" on sm_70, which has no TF32 tensor cores); for
    fp16/bf16 "input" (16-bit operands straight into the tensor cores, fp32 accumulation) from sm_80 on,
    "input_emulated" in the interpreter (CPU tensors: the same rounded operands, exact fp32 products,
    since the interpreter's matmul does not take bf16). Below sm_80 16-bit inputs are refused
    (UnsupportedBackend): the kernels' 16-bit dots need bf16 / fp16 MMA with fp32 accumulation as Triton emits it
    from sm_80 on, and multiplying them in fp32 there would time an emulation under a 16-bit label."""
    if dtype == torch.float32:
        fp32 = FP32_DOT_PRECISION if fp32 is None else fp32
        return "ieee" if capability is not None and capability < TF32_CAPABILITY else fp32
    if capability is None:
        return "input_emulated"
    if capability < TF32_CAPABILITY:
        raise UnsupportedBackend(
            f"the Triton kernels take {dtype} inputs from sm_80 on (16-bit tensor-core dots); this GPU is sm_{capability}: use float32 or backend='torch'"
        )
    return "input"


#: The widest chunk whose [C, C] tiles leave room for [C, 64] tiles and 4 warps (16-bit operands).
WIDE_TILE_CHUNK = 64


def tile_plan(precision: str, block_c: int, widest: int) -> tuple[int, int]:
    """``(columns, num_warps)`` of a chunk kernel's [C, ·] tiles: ``widest`` and 4 warps with 16-bit operands
    up to C = ``WIDE_TILE_CHUNK``; half as wide with fp32 operands (FMA dots hold more registers per element);
    at C = 128 half again with 8 warps (its [C, C] fp32 tiles alone take 128 registers a thread at 4 warps:
    16-bit forwards spilled 0.4-0.6 KB a thread on sm_80 / sm_90, docs/performance.md)."""
    sixteen_bit = precision.startswith("input")
    columns = widest if sixteen_bit else widest // 2
    if block_c > WIDE_TILE_CHUNK:
        columns //= 2
    return max(16, columns), 4 if sixteen_bit and block_c <= WIDE_TILE_CHUNK else 8


class Packing:
    """Where the chunks of packed sequences lie (``cu_seqlens``, B = 1): each sequence cut into chunks of its own, so
    that none straddles a boundary. ``chunks`` int32 ``[n_chunks, 2]``: each chunk's first token and end (exclusive);
    ``sequences`` int32 ``[N + 1]``: each sequence's first chunk (and the total at the end). Built on the host from the
    offsets as ints, once per (offsets, chunk size, device): ``packing``."""

    def __init__(self, bounds: tuple[int, ...], chunk_size: int, device: torch.device):
        spans = [(start, min(start + chunk_size, stop)) for first, stop in zip(bounds[:-1], bounds[1:]) for start in range(first, stop, chunk_size)]
        firsts = [0]
        for first, stop in zip(bounds[:-1], bounds[1:]):
            firsts.append(firsts[-1] + triton.cdiv(stop - first, chunk_size))
        self.num_sequences, self.num_chunks = len(bounds) - 1, len(spans)
        self.chunks = torch.tensor(spans, dtype=torch.int32, device=device)
        self.sequences = torch.tensor(firsts, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def _packing(bounds: tuple[int, ...], chunk_size: int, device: torch.device) -> Packing:
    return Packing(bounds, chunk_size, device)


def packing(name: str, q: torch.Tensor, cu_seqlens, chunk_size: int) -> Packing | None:
    """The ``Packing`` of ``cu_seqlens`` (offsets as ints, or an int tensor: then read on the host) for the
    kernels of ``name`` on ``q`` ``[1, H, T, ·]`` at ``chunk_size``, cached per (offsets, chunk size, device): a
    call with the offsets of an earlier one copies nothing to the device. None for None; VariantError for offsets
    that do not increase from 0 to T or a batch other than 1."""
    if cu_seqlens is None:
        return None
    bounds = tuple(cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else map(int, cu_seqlens))
    if q.shape[0] != 1:
        raise VariantError(f"{name}: with cu_seqlens the sequences are packed into one row, q [1, H, total_T, F]; got batch {q.shape[0]}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != q.shape[2] or any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise VariantError(f"{name}: cu_seqlens must increase from 0 to T={q.shape[2]} (no empty sequence), got {list(bounds)}")
    return _packing(bounds, chunk_size, q.device)


class Tiles:
    """Sizes of one call and what every kernel of a rule launches with: ``precision`` the ``dot``
    precision (``operand_precision``; ``precision`` the one asked for float32). Over packed sequences
    (``packing``) the chunks are the sequences' own and the states (initial, final) one per sequence and head:
    ``state_batch`` N instead of B. Each rule's subclass sets ``block_f``, ``block_v`` (the state block of one
    program), ``num_warps`` and ``num_stages``."""

    def __init__(self, batch, heads, seq_len, d_dot, d_value, chunk_size, dtype, device, precision=None, packing: Packing | None = None):
        self.batch, self.heads, self.seq_len, self.d_dot, self.d_value = batch, heads, seq_len, d_dot, d_value
        self.bh = batch * heads
        self.chunk_size = chunk_size
        self.packing, self.varlen = packing, packing is not None
        self.num_chunks = packing.num_chunks if packing else triton.cdiv(seq_len, chunk_size)
        self.state_batch = packing.num_sequences if packing else batch
        self.state_rows = self.state_batch * heads
        self.block_c, self.pad_f, self.pad_v = pad(chunk_size), pad(d_dot), pad(d_value)
        self.precision = operand_precision(dtype, capability(device), precision)

    def sizes(self) -> tuple[int, ...]:
        """The runtime size arguments every kernel takes: ``seq_len, d_dot, d_value, chunk_size, num_chunks``."""
        return (self.seq_len, self.d_dot, self.d_value, self.chunk_size, self.num_chunks)

    def tables(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk and sequence tables of packed sequences (``Packing``), else ``like`` twice (never read: VARLEN off)."""
        return (self.packing.chunks, self.packing.sequences) if self.varlen else (like, like)

    def options(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program (thread block) may hold on a GPU: ``shared`` bytes of shared memory (the opt-in
    maximum per block) and ``registers`` per block (64 K on sm_70 to sm_90)."""

    shared: int
    registers: int = 65536


def over_limits(shared_bytes: int, registers: int, num_warps: int, limits: Limits) -> list[str]:
    """What a compiled kernel of ``num_warps`` warps needs beyond ``limits`` (empty when it fits): the one test
    both the launch (``fitting``, on the GPU's own limits) and ``attnbench kernels`` (each target's) apply."""
    problems = []
    if shared_bytes > limits.shared:
        problems.append(f"shared memory {shared_bytes} B > {limits.shared} B per block")
    if registers * 32 * num_warps > limits.registers:
        problems.append(f"{registers} registers × {32 * num_warps} threads > {limits.registers} per block")
    return problems


def device_limits(device: torch.device) -> Limits:
    """The limits of a CUDA device, as Triton's driver reads them (the opt-in shared memory per block)."""
    properties = triton.runtime.driver.active.utils.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    return Limits(shared=properties["max_shared_mem"], registers=properties.get("max_num_regs", Limits.registers))


def fitting(kernel, configs: list, args: dict, constexprs: dict) -> list:
    """The autotuning ``configs`` of ``kernel`` (a @triton.jit function) that fit the GPU its tensor ``args``
    are on (``keep_fitting``, each compiled as its timing would compile it); on other devices (the interpreter,
    recording on "meta", where ``attnbench kernels`` applies each target's limits) all of them."""
    device = next(a.device for a in args.values() if isinstance(a, torch.Tensor))
    if device.type != "cuda":
        return configs
    # the kernel's own arguments only: the autotuner hands its pruner its launch keywords too (grid, warmup)
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    return keep_fitting(kernel.__name__, configs, lambda config: kernel.warmup(**args, **constexprs, **config.all_kwargs(), grid=(1,)), device_limits(device))


def keep_fitting(name: str, configs: list, compile_config, limits: Limits) -> list:
    """The ``configs`` whose kernel (``compile_config(config)``, a Triton CompiledKernel) is not ``over_limits``;
    none is an error (UnsupportedBackend) naming the kernel and what each needs."""
    kept, needs = [], []
    for config in configs:
        compiled = compile_config(config)
        shared, registers = compiled.metadata.shared, 0
        if shared <= limits.shared:  # (loading one over it raises)
            compiled._init_handles()  # loads it: the device reports its registers
            registers = compiled.n_regs
        problems = over_limits(shared, registers, config.num_warps, limits)
        (needs if problems else kept).append(problems or config)
    if not kept:
        raise UnsupportedBackend(f"{name}: no tile configuration fits this GPU: {'; '.join(map('; '.join, needs))}")
    return kept


def check_inputs(name: str, kernel, q, k, v, *others, value_groups: bool = False) -> None:
    """Shapes ``q, k: [B, H, T, F]``, ``v: [B, H, T, Dv]`` (with ``value_groups``, GVA: v's heads a multiple of q's),
    F and Dv ≤ MAX_HEAD_DIM, one dtype among ``SUPPORTED_DTYPES`` for q, k, v, one device for all (``others`` may
    hold None), and a device ``kernel`` runs on: CUDA, the CPU through the interpreter, or "meta" while recording."""
    four = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
    heads = four and (v.shape[1] % q.shape[1] == 0 if value_groups else v.shape[1] == q.shape[1])
    if not heads or k.shape != q.shape or (v.shape[0], v.shape[2]) != (q.shape[0], q.shape[2]):
        shapes = ", ".join(f"{n} {tuple(getattr(t, 'shape', ()))}" for n, t in (("q", q), ("k", k), ("v", v)))
        grouped = " (v's heads a multiple of q's)" if value_groups else ""
        raise VariantError(f"{name} expects q, k: [B, H, T, F] and v: [B, H, T, Dv]{grouped}, got {shapes}")
    d_dot, d_value = q.shape[-1], v.shape[-1]
    if d_dot > MAX_HEAD_DIM or d_value > MAX_HEAD_DIM:
        raise UnsupportedBackend(f"{name} supports d_dot and d_value up to {MAX_HEAD_DIM}, got d_dot={d_dot}, d_value={d_value}: use backend='torch'")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedBackend(
            f"{name} takes q, k, v of one dtype among float32, float16, bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}: use backend='torch'"
        )
    devices = {t.device for t in (q, k, v, *others) if t is not None}
    if len(devices) != 1:
        raise VariantError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = q.device
    if device.type == "cpu" and isinstance(kernel, triton.runtime.JITFunction):
        raise UnsupportedBackend(f"{name} on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported")
    if device.type not in ("cpu", "cuda") and not (device.type == "meta" and _recording is not None):
        raise VariantError(f"{name} runs on CUDA devices (or the CPU interpreter), got {device.type}")


def check_precision(name: str, precision) -> None:
    """``precision`` is one of ``PRECISIONS``."""
    if precision not in PRECISIONS:
        raise VariantError(f"{name}: precision must be one of {', '.join(map(repr, PRECISIONS))} (the dots of float32 inputs), got {precision!r}")


def launch(kernel, grid, *args, options: dict, name: str | None = None, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs, **options)`` on the device of the first tensor argument;
    while ``recording``, the launch is kept as a :class:`Launch` instead (``name`` labels it). An
    ``@triton.autotune`` kernel takes ``grid`` as a function of its config's constexprs and no ``options``
    (its configs carry them); recording keeps one launch per candidate its ``early_config_prune`` leaves,
    named ``name[constexpr=value,w=warps]``, so that ``attnbench kernels`` compiles every candidate; through
    the interpreter (CPU tensors) the first candidate it leaves runs, untimed. While ``identity.recording``,
    the launch is noted there (``identity.note``)."""
    if _recording is not None:
        name = _launch_name(kernel, name)
        if isinstance(kernel, triton.runtime.Autotuner):
            for config in kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, args)), **constexprs):
                meta = {**constexprs, **config.kwargs}
                label = ",".join([*(f"{key}={value}" for key, value in config.kwargs.items()), f"w={config.num_warps}"])
                options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
                _recording.append(Launch(f"{name}[{label}]", kernel.fn, tuple(grid(meta)), args, meta, options))
        else:
            _recording.append(Launch(name, kernel, tuple(grid), args, constexprs, options))
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    tuner = kernel if isinstance(kernel, triton.runtime.Autotuner) else None
    if tuner is not None and device.type == "cpu":
        # nothing to time in the interpreter (Triton 3.6's autotuner would time even a lone candidate: a GPU call)
        config = kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, args)), **constexprs)[0]
        kernel, options = kernel.fn, config.all_kwargs()
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if identity.entries is None:
            kernel[grid](*args, **constexprs, **options)
        else:
            identity.note(_launch_name(kernel, name), kernel, lambda: kernel[grid](*args, **constexprs, **options), constexprs, options, tuner)


def _launch_name(kernel, name: str | None) -> str:
    """``name``, else the kernel's function name without its underscores and "_kernel" ("_output_kernel" -> "output")."""
    return name or identity.python_function(kernel).__name__.strip("_").removesuffix("_kernel")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the @triton.jit function, its grid, its arguments (tensors on
    "meta" and ints, in order), its constexprs and its options (num_warps, num_stages)."""

    name: str
    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    options: dict

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


@contextlib.contextmanager
def recording(target_capability: int):
    """Collect the launches of host code run on "meta" tensors (nothing runs), planning for a GPU of
    compute capability ``target_capability`` (×10)."""
    global _recording, _recording_capability
    if _recording is not None:
        raise RuntimeError("recording is not reentrant")
    _recording, _recording_capability = [], target_capability
    try:
        yield _recording
    finally:
        _recording, _recording_capability = None, None


def shipped_shapes(rule: str):
    """``(dtype, d_dot, d_value, chunk_size)`` of every configuration of ``rule`` a variant reaches: each dtype,
    head dim and wide key at every chunk size the rule takes there (``kernels.chunk_sizes``)."""
    for dtype in DTYPE_NAMES:
        for d_dot, d_value in [(d, d) for d in HEAD_DIMS] + [(d_dot, 64) for d_dot in WIDE_KEYS]:
            for chunk in chunk_sizes(rule, d_dot):
                yield dtype, d_dot, d_value, chunk


def meta_tensor(*shape, dtype=torch.float32) -> torch.Tensor:
    """A "meta" leaf that requires grad (no memory: recording only needs shapes and dtypes)."""
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def record_training_step(entry, capability: int, inputs: list, **kwargs) -> list[Launch]:
    """The launches of ``entry(*inputs, **kwargs)`` and of the backward of its first output into
    every input (a training step), planned for ``capability``."""
    with recording(capability) as launches:
        out = entry(*inputs, **kwargs)[0]
        torch.autograd.grad(out, [t for t in inputs if t is not None and t.requires_grad], torch.empty_like(out))
    return launches


# --------------------------------------------------------------------------------------
# @triton.jit helpers. Token tensors are contiguous [B·H, seq_len, width]; states [B·H, d_dot, d_value].
# --------------------------------------------------------------------------------------


@triton.jit
def chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN: tl.constexpr):
    """The first token of chunk ``chunk`` and a bound its tokens end before: with VARLEN (packed sequences) row
    ``chunk`` of the chunk table (``Packing.chunks``), the chunk's first token and end; else chunk·C and T."""
    if VARLEN:
        start = tl.load(chunk_table_ptr + 2 * chunk)
        stop = tl.load(chunk_table_ptr + 2 * chunk + 1)
    else:
        start = chunk * chunk_size
        stop = seq_len
    return start, stop


@triton.jit
def sequence_chunks(program, heads, num_chunks, sequence_table_ptr, VARLEN: tl.constexpr):
    """What a sequential pass's program walks: its b·h (the token and chunk-state row), and the chunks of its
    sequence, first and end (exclusive). ``program`` is its state row: b·h, or with VARLEN sequence·H + h
    (``Packing.sequences`` holds each sequence's first chunk; packed input has B = 1)."""
    if VARLEN:
        sequence = program // heads
        bh = program % heads
        first = tl.load(sequence_table_ptr + sequence)
        end = tl.load(sequence_table_ptr + sequence + 1)
    else:
        bh = program
        first = 0
        end = num_chunks
    return bh, first, end


@triton.jit
def chunk_rows(start, stop, chunk_size, BLOCK_C: tl.constexpr):
    """Token indices of the chunk from ``start`` (``chunk_span``) and which of them are real: within the chunk
    and before ``stop``."""
    rows = tl.arange(0, BLOCK_C)
    tokens = start + rows
    return tokens, (rows < chunk_size) & (tokens < stop)


@triton.jit
def token_tile(bh, seq_len, tokens, token_ok, cols, width):
    """Offsets and mask of ``tokens`` (where ``token_ok``), columns ``cols`` of a [B·H, seq_len, width] tensor."""
    offs = bh * seq_len * width + tokens[:, None] * width + cols[None, :]
    mask = token_ok[:, None] & (cols < width)[None, :]
    return offs, mask


@triton.jit
def load_chunk(ptr, bh, start, stop, chunk_size, seq_len, width, col_start, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    """The chunk's tokens ``start`` .. ``stop`` (``chunk_span``), columns col_start .. col_start + BLOCK of a
    [B·H, seq_len, width] tensor, in its own dtype (16-bit tiles go into ``dot`` as they are), zeros outside (padding)."""
    tokens, token_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    offs, mask = token_tile(bh, seq_len, tokens, token_ok, col_start + tl.arange(0, BLOCK), width)
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def state_tile(bh, rows, cols, d_dot, d_value):
    """Offsets and mask of rows ``rows``, columns ``cols`` of a contiguous [B·H, d_dot, d_value] state."""
    offs = bh * d_dot * d_value + rows[:, None] * d_value + cols[None, :]
    mask = (rows < d_dot)[:, None] & (cols < d_value)[None, :]
    return offs, mask


@triton.jit
def load_or_zeros(ptr, offs, mask, PRESENT: tl.constexpr):
    """``ptr[offs]`` as float32 (masked, 0 outside) when ``PRESENT``, else float32 zeros of ``offs``'s shape."""
    if PRESENT:
        values = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        values = tl.zeros(offs.shape, dtype=tl.float32)
    return values


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, INPUT_TYPE: tl.constexpr):
    """``a @ b`` accumulated in float32 (``operand_precision``): with "input" both operands are cast to
    ``INPUT_TYPE`` (the 16-bit input dtype: a 16-bit MMA), with "input_emulated" rounded to it and
    multiplied in fp32 (the same products), else multiplied as fp32 at ``PRECISION`` ("ieee", "tf32")."""
    if PRECISION == "input":
        out = tl.dot(a.to(INPUT_TYPE), b.to(INPUT_TYPE), out_dtype=tl.float32)
    elif PRECISION == "input_emulated":
        out = tl.dot(a.to(INPUT_TYPE).to(tl.float32), b.to(INPUT_TYPE).to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return out
