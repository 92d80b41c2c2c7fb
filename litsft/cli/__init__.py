"""The command line above the training loop: the launcher (processes, rendezvous, the run lock), the checks made before anything starts, the one-line parse errors, and `litsft demo`."""
