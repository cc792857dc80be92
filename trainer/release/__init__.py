"""Releases: a candidate's weights become a verified delta in the artifact store and a
`ReleasePublished` (`pipeline.py`), once the eval gate (`eval_gate.py`) passes it; rollbacks
the same way back. `weights.py` loads candidates and base weights, `config.py` holds the
settings. The delta codec and the artifact store themselves are kernels/delta/ (a replica
applies a release with them too: serving/hot_swap.py)."""
