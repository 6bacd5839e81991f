"""What quantization does to a model's output: perplexity, KL divergence, lm-eval tasks."""
