"""Execution engines: run the model, compute target logprobs, backprop, step the optimizer."""
