"""Training an MTP head on a frozen target (``lattice train-mtp``): data, model, loop, export, command."""
