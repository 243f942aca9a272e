"""The floor every group stands on: files written atomically and never through a planted link (``files``),
how numbers and quoted values are written (``formatting``), caches read as data that may be wrong
(``caches``), and two git revisions checked out side by side (``checkouts``).

Imports no other harness group."""
