"""Quality tasks: small models built on attnbench variants, trained and evaluated as one cell."""
