"""Multi-run studies: one YAML per study in this folder, launched with ``python -m sweeps.run STUDY``."""
