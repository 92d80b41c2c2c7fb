"""Using a trained model: batched greedy and sampled generation (`litsft generate`, validation samples, the demo)."""
