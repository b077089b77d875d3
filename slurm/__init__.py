"""Where ranks come from: the local executor today, Slurm (submitit) next."""
