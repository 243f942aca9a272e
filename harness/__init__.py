"""attnbench's harness: scenarios, measurement, results, reports (see ../shared/DESIGN.md)."""
