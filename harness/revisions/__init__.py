"""Two git revisions of attnbench against each other: ``regress`` (an interleaved run of both), its
correctness check run inside each checkout (``regress_check``, run by path) and ``bisect``; ``commits``
measures a scenario at each commit of a range (``attnbench run --commits``).

May import: common, scenarios, measuring, running, results, kernels, variants."""
