"""Short causal mixing of neighbouring tokens that some variants pair with their attention:
Based's short depthwise convolution and RWKV's token shift. Each has a parallel form over a
sequence that continues from the inputs before it, and a one-token ``step`` over a rolling
buffer of those inputs, so that a layer using them decodes exactly what it trains on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Causal depthwise convolution of width K (Arora et al. 2024, Based, §4; Poli et al. 2023):
    y_t = b + Σ_{j=0}^{K−1} w_j ⊙ x_{t−K+1+j}, so output t sees inputs t − K + 1 .. t.

    ``x: [B, T, d] -> [B, T, d]``. ``window`` holds the K − 1 inputs before ``x`` (zeros at the
    start of a sequence), ``[B, K − 1, d]``: the decoding state.
    """

    def __init__(self, d_model: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model)

    def forward(self, x, window=None):
        if window is None:
            return self.conv(F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0))).transpose(1, 2)
        return self.conv(torch.cat([window, x], 1).transpose(1, 2)).transpose(1, 2)

    def packed(self, x, bounds):
        """The convolution over sequences packed in ``x: [1, total_T, d]`` (``bounds``: ``cu_seqlens``
        as ints), each from zeros: a tap that would read across a sequence's start reads zero."""
        taps = F.pad(x, (0, 0, self.kernel_size - 1, 0)).unfold(1, self.kernel_size, 1)  # [1, T, d, K]: tap j reads t − K + 1 + j
        reads = torch.arange(x.shape[1], device=x.device)[:, None] - self.kernel_size + 1 + torch.arange(self.kernel_size, device=x.device)
        starts = torch.repeat_interleave(torch.tensor(bounds[:-1], device=x.device), torch.tensor(bounds, device=x.device).diff())
        taps = taps * (reads >= starts[:, None]).to(x.dtype)[:, None, :]
        return (taps * self.conv.weight.squeeze(1)).sum(-1) + self.conv.bias

    def packed_windows(self, x, bounds):
        """Each packed sequence's decoding window after its last token, ``[N, K − 1, d]`` (zeros before its start)."""
        starts, stops = (torch.tensor(b, device=x.device)[:, None] for b in (bounds[:-1], bounds[1:]))
        reads = stops - self.kernel_size + 1 + torch.arange(self.kernel_size - 1, device=x.device)  # [N, K − 1]
        return x[0, reads.clamp(min=0)] * (reads >= starts).to(x.dtype)[..., None]

    def init_window(self, batch: int, *, device=None, dtype=None):
        return torch.zeros(batch, self.kernel_size - 1, self.conv.in_channels, device=device, dtype=dtype)

    def next_window(self, x, window):
        """The K − 1 inputs before the token after ``x``."""
        return torch.cat([window, x], 1)[:, x.shape[1] :]

    def step(self, x_t, window):
        """One token: ``x_t: [B, d]`` -> ``(y_t [B, d], next window)``."""
        taps = torch.cat([window, x_t.unsqueeze(1)], 1)  # [B, K, d]
        y_t = torch.einsum("bkd,dk->bd", taps, self.conv.weight.squeeze(1)) + self.conv.bias
        return y_t, taps[:, 1:]


class TokenShift(nn.Module):
    """RWKV's token shift (Peng et al. 2023, RWKV-4, eq. 11-13): for each of ``n`` targets
    (receptance, key, value), x'_t = μ ⊙ x_t + (1 − μ) ⊙ x_{t−1}, with learnable μ ∈ R^d per target
    (initialised to 1/2) and x_0 = the ``previous`` input (zeros at the start of a sequence).

    ``x: [B, T, d] -> [n, B, T, d]``.
    """

    def __init__(self, d_model: int, n: int = 3):
        super().__init__()
        self.mix = nn.Parameter(torch.full((n, 1, 1, d_model), 0.5))

    def forward(self, x, previous=None):
        if previous is None:
            previous = torch.zeros_like(x[:, 0])
        shifted = torch.cat([previous.unsqueeze(1), x[:, :-1]], 1)
        return self.mix * x + (1 - self.mix) * shifted

    def packed(self, x, bounds):
        """The shift over sequences packed in ``x: [1, total_T, d]`` (``bounds``), each from zeros."""
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        shifted[:, bounds[:-1]] = 0
        return self.mix * x + (1 - self.mix) * shifted
