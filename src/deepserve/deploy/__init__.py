"""Beyond one machine: the Ray cluster (`deepserve cluster`), deployment files rendered from one config or plan
(`deepserve deploy render`: Kubernetes, docker compose, Slurm), and the preflight a node runs before it spends GPU
hours (`deepserve deploy check`)."""
