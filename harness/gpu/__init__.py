"""A GPU machine: ``gpu-check`` (the first command on one, offline) and the ``kit`` it needs, gathered on
a machine with internet.

May import: common, scenarios, measuring, running, results, report, tasks."""
