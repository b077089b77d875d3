"""Where ranks come from and what happens to them: local processes, srun steps of an
allocation, sbatch jobs (submitit); one rank's bring-up; the one supervisor that retries,
blames and relaunches for all three."""
