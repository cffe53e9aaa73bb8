"""Launch helpers: render sbatch scripts from the Hydra config and submit them (Slurm), or
run a stage with torchrun on this machine (``cluster=local``)."""
