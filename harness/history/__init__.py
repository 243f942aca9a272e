"""Performance over time: every commit, every machine, steps found (``attnbench history``)."""
