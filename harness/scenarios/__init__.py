"""What to measure: a scenario's schema (``schema``), reading and merging its file (``scenario_files``),
the loader (``scenario``), the axes table (``axes``), sequence lengths (``lengths``), expansion into
cells (``expansion``), the typed cell (``cell``) and plugins (``plugins``).

May import: common, measuring (timing modes, a cell's shapes), models (presets), tasks (the registry and
its dtype policy), variants."""
