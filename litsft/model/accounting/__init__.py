"""What a model costs, computed from the model: parameter and memory sizes, FLOPs."""
