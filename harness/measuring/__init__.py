"""How one thing is measured: timing and memory (``measure``), statistics of samples (``stats``),
roofline and calibration (``roofline``), the machine fingerprint (``machine``), how busy it was
(``busyness``), accuracy against float64 (``accuracy``), profiles (``profiling``) and what a cell
builds (``builders``).

May import: common, models, variants; the typed cell (``scenarios.cell``) for its type only."""
