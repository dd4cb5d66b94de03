"""DP-SGD, pure: Poisson sampling, per-sample norms, clipping, noise."""
