"""What Triton's interpreter (``TRITON_INTERPRET=1``, the CPU runs of the tests) needs from the oldest
supported Triton, 3.6.

Its interpreter passes every runtime int argument as a one-element array and converts it back to an int
(``range(0, d_dot, BLOCK_F)``, ``range(num_chunks)``) with ``int(array)``, which numpy 2.4 refuses for an
array of one dimension ("only 0-dimensional arrays can be converted to Python scalars";
triton-lang/triton#9171, fixed by #9172: 3.8 and 3.9 have the fix, 3.7 is not checked here).
:func:`patch_scalar_index` gives 3.6 the fixed conversion; ``_common`` applies it on import.
"""

from __future__ import annotations

import triton

#: The first Triton checked to convert interpreter scalars to ints itself.
FIXED_IN = (3, 8)


def version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "3.9.0+git1234"."""
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def patch_scalar_index() -> None:
    """Make the interpreter's ``tensor.__index__`` read the single element (``int(data.squeeze())``, as
    Triton ≥ 3.8 does) on Triton versions before ``FIXED_IN``; nothing on later ones. Idempotent."""
    if version(triton.__version__) >= FIXED_IN:
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "reads_single_element", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.reads_single_element = True
    interpreter._patch_lang_tensor = patch_lang_tensor
