"""Per-rank execution: model loading, the denoising loop, attention states, outputs."""
