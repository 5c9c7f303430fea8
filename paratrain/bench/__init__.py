"""Benchmarks: paratrain side by side with PyTorch's own implementation (paratrain bench KIND)."""
