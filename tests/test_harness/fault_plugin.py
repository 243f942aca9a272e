"""A plugin for the runner tests: variants that fail on purpose (loaded with --plugin).

fault_oom raises an out-of-memory error, fault_error an exception, fault_crash exits its
worker process, fault_kill kills it with SIGKILL, fault_nan returns NaN, fault_slow sleeps (to be interrupted mid-sweep).
"""

import os
import signal
import time

import torch

import variants
from variants.base import AttentionCore


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
