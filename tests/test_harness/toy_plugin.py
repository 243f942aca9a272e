"""One plugin file that adds a variant with a per-token input of its own and a task, without a
change to attnbench (docs/extending.md walks through it; tests/test_harness/test_extending.py runs it).

- ``toy_tempered``: causal softmax attention whose query t divides its scores by its own
  temperature τ_t ∈ [0.5, 2] (a new ``TokenInput``, ``temperature``):
  y_t = Σ_{s≤t} softmax_s(q_t·k_s / (√d τ_t)) v_s.
- ``toy_spread``: a task that runs a variant's parallel form on its example inputs at width
  ``axes.width`` and reports the spread (standard deviation) of the output, times ``scale``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

import variants
from harness import tasks
from harness.scenarios.cell import Cell
from variants.base import AttentionCore, TokenInput, activated_linear

TEMPERATURE = TokenInput(
    "temperature",
    "the softmax temperature of each query",
    draw=lambda shape, *, generator=None, device=None, dtype=None: 0.5 + 1.5 * torch.rand(shape, generator=generator, device=device, dtype=dtype),
    bounds=(0.5, 2.0),
    layer=activated_linear(lambda x: 0.5 + 1.5 * torch.sigmoid(x)),
    owner="toy_tempered",
)


@variants.register("toy_tempered")
class TemperedSoftmax(AttentionCore):
    token_inputs = (TEMPERATURE,)
    supports_noncausal = False

    def __init__(self, d_key: int):
        super().__init__(d_key)
        self.d_dot = None

    def _scores(self, q, k, temperature):
        return q @ k.transpose(-1, -2) / (math.sqrt(self.d_key) * temperature[..., None])

    def _parallel(self, q, k, v, causal, *, temperature):
        scores = self._scores(q, k, temperature)
        future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
        return torch.softmax(scores.masked_fill(future, -math.inf), dim=-1) @ v

    def _reference(self, q, k, v, causal, *, temperature):
        rows = [
            torch.softmax(self._scores(q[:, :, t : t + 1], k[:, :, : t + 1], temperature[:, :, t : t + 1]), -1) @ v[:, :, : t + 1] for t in range(q.shape[2])
        ]
        return torch.cat(rows, dim=2)

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None):
        return (torch.zeros(batch, heads, 0, self.d_key, device=device, dtype=dtype), torch.zeros(batch, heads, 0, d_value, device=device, dtype=dtype))

    def _prefill(self, q, k, v, state, *, temperature):
        state = state if state is not None else self.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        outputs = []
        for t in range(q.shape[2]):
            out, state = self._step(q[:, :, t], k[:, :, t], v[:, :, t], state, temperature=temperature[:, :, t])
            outputs.append(out)
        return torch.stack(outputs, dim=2), state

    def _step(self, q_t, k_t, v_t, state, *, temperature):
        keys, values = (torch.cat([cache, x[:, :, None]], dim=2) for cache, x in zip(state, (k_t, v_t)))
        weights = torch.softmax(self._scores(q_t[:, :, None], keys, temperature[:, :, None]), dim=-1)
        return (weights @ values)[:, :, 0], (keys, values)

    def flops(self, batch, heads, length, d_value, *, causal=True):
        return 2 * batch * heads * length * length * (self.d_key + d_value)

    def step_flops(self, batch, heads, d_value, position):
        return 2 * batch * heads * (position + 1) * (self.d_key + d_value)

    def state_numel(self, batch, heads, d_value, length):
        return batch * heads * length * (self.d_key + d_value)


class SpreadConfig(tasks.TaskConfig):
    name: Literal["toy_spread"]
    scale: float = 1.0


def run_spread(cell: Cell) -> dict:
    config = SpreadConfig.model_validate(cell.task)
    width = cell.axes["width"]
    core = variants.create(cell.variant, width, backend=cell.backend, **cell.params)
    inputs = core.example_inputs(1, 2, 16, width, generator=torch.Generator().manual_seed(0))
    return {"spread": config.scale * float(core(**inputs).std()), "loss": 0.0}


def spread_sections(cells, figures, name: str) -> list:
    from harness.common.formatting import text
    from harness.report.figures import table

    ok = cells[cells["status"] == "ok"]
    return [table("Toy spread", ok, [("variant", "series", text), ("width", "axes.width", text), ("spread", "metrics.spread", text)])]


tasks.register(
    tasks.Task(
        name="toy_spread",
        config=SpreadConfig,
        axes=("width",),
        run=run_spread,
        d_keys=lambda config, axes: axes["width"],
        metrics=("spread",),
        report=spread_sections,
    )
)
