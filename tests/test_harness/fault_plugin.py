"""A plugin for the runner tests: variants that fail on purpose (loaded with --plugin).

fault_oom raises an out-of-memory error, fault_error an exception, fault_crash exits its
worker process, fault_kill kills it with SIGKILL, fault_nan returns NaN, fault_slow sleeps (to be interrupted mid-sweep).
fault_kill_once is linear attention that kills its worker with SIGKILL at its FAULT_KILL_AT-th
forward call while the file FAULT_KILL_MARKER exists (removing it first): a training cell dies
once, mid-training.
"""

import os
import signal
import time

import torch

import variants
from variants.base import AttentionCore
from variants.sum_rule import SumRule


class _Fault(AttentionCore):
    def init_state(self, batch, heads, d_value, *, device=None, dtype=None):
        return None

    def flops(self, batch, heads, length, d_value, *, causal=True):
        return 0

    def _parallel(self, q, k, v, causal):
        return self.fail(v)


def _fault(name, behaviour):
    cls = type(name, (_Fault,), {"fail": staticmethod(behaviour)})
    variants.register(name)(cls)


def _oom(v):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB (injected by the test plugin)")


def _error(v):
    raise RuntimeError("injected failure")


def _crash(v):
    os._exit(3)


def _nan(v):
    return torch.full_like(v, float("nan"))


def _slow(v):
    time.sleep(float(os.environ.get("FAULT_SLOW_S", "0.2")))
    return v.clone()


for _name, _behaviour in [("fault_oom", _oom), ("fault_error", _error), ("fault_crash", _crash), ("fault_nan", _nan), ("fault_slow", _slow)]:
    _fault(_name, _behaviour)


def _killed(v):
    os.kill(os.getpid(), signal.SIGKILL)


_fault("fault_kill", _killed)


@variants.register("fault_kill_once")
class _KillOnce(SumRule):
    calls = 0

    def forward(self, q, k, v, **kwargs):
        _KillOnce.calls += 1
        marker = os.environ.get("FAULT_KILL_MARKER")
        if marker and os.path.exists(marker) and _KillOnce.calls == int(os.environ["FAULT_KILL_AT"]):
            os.unlink(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(q, k, v, **kwargs)
