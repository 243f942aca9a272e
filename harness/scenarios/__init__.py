"""What to measure: a scenario's schema (``schema``), reading and merging its file (``scenario_files``),
what does not validate, in words (``validation``), the loader (``scenario``), the axes table (``axes``),
sequence lengths (``lengths``), expansion into cells (``expansion``), the typed cell (``cell``) and plugins
(``plugins``). Nothing here imports torch until a scenario's cells are expanded (``expansion``).

May import: common, measuring (timing modes, a cell's shapes), models (presets), tasks (the registry and
its dtype policy), variants."""
