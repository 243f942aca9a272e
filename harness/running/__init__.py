"""Running a sweep: the run loop (``runner``), the worker process (``worker``) and what it measures
(``workloads``), the executors (``executors``: local, Ray), and a sweep planned before it runs
(``estimate``, ``planning``).

May import: common, scenarios, measuring, results, tasks, variants."""
