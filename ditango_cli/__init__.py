"""The `ditango` command line: a thin shell over runtime/, planner/ and slurm/."""
