"""``specmesh bench``: speed as ratios against baselines measured in the same run."""
