"""Several nodes as clusters start them: the scheduler's conventions (Slurm), read into torchrun's rendezvous."""
