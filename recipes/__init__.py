"""The training entry points, shipped in the wheel as `litsft.recipes` (from a checkout, bound by litsft/__init__)."""
